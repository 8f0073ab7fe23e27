"""What structured outputs cost: decode throughput of a batch where half the
sequences follow a JSON schema, divided by the same batch unconstrained.

Both batches run through the real scheduler and the bare model runner in this
process (no Ray), so the difference is the grammars' own work on the rank:
filling each constrained row's bitmask from its matcher, applying the masks in
the sampler, advancing the matchers. The schema (a JSON list of at least 10 000
strings) never lets a sequence end before ``max_tokens``, so both batches
compute exactly the same number of tokens. Rounds alternate the two batches
and the medians are compared. It prints figures; it never asserts.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from iterserve.scheduler import Request, SamplingParams, Scheduler
from iterserve.scheduler.config import SchedulerConfig
from iterserve.scheduler.sampling import StructuredOutput

SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 10_000}


class StructuredBench:
    def __init__(self, model: str, num_seqs: int, max_tokens: int, prompt_len: int = 16):
        import torch

        from iterserve.workers.runner import ModelRunner

        torch.set_num_threads(1)
        block_size = 16
        max_model_len = 256
        per_seq = -(-(prompt_len + max_tokens) // block_size)
        self.config = SchedulerConfig(
            policy="continuous",
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(256, num_seqs * prompt_len),
            max_model_len=max_model_len,
            block_size=block_size,
            # every sequence fits at once: nothing is preempted in either batch
            num_kv_blocks=max(num_seqs * per_seq, max_model_len // block_size),
        )
        self.runner = ModelRunner(model, dtype="float32", num_kv_blocks=self.config.num_kv_blocks,
                                  block_size=block_size, kernel_backend="torch")  # fmt: skip
        self.prompts = [
            [10 + (i * 7 + j) % 300 for j in range(prompt_len)] for i in range(num_seqs)
        ]
        free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        grammar = StructuredOutput("json", json.dumps(SCHEMA))
        constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                     structured_output=grammar)  # fmt: skip
        self.batches = {
            "unconstrained": [free] * num_seqs,
            "half_constrained": [constrained if i % 2 else free for i in range(num_seqs)],
        }

    def run(self, name: str) -> tuple[float, float, int]:
        """One batch to its end: tokens per second of the runner alone, by the wall
        clock and by this thread's CPU time (the runner computes on it, one torch
        thread), and the tokens."""
        sched = Scheduler(self.config)
        for i, (prompt, params) in enumerate(zip(self.prompts, self.batches[name])):
            sched.add_request(Request(f"{name}-{i}", prompt, params))
        wall_s = cpu_s = 0.0
        num_tokens = 0
        while sched.has_work:
            step = sched.schedule(time.monotonic())
            wall, cpu = time.perf_counter(), time.thread_time()
            result = self.runner.execute(step.plan)
            wall_s += time.perf_counter() - wall
            cpu_s += time.thread_time() - cpu
            num_tokens += len(result.sampled)
            sched.update(step, result)
        return num_tokens / wall_s, num_tokens / cpu_s, num_tokens


def structured_cost(
    model: str | None = None, num_seqs: int = 16, max_tokens: int = 64, rounds: int = 5
) -> dict:
    bench = StructuredBench(model or _default_model(), num_seqs, max_tokens)
    for name in bench.batches:  # one-off costs: the grammar's compile, first allocations
        bench.run(name)
    runs: dict[str, list[float]] = {name: [] for name in bench.batches}
    cpu: dict[str, list[float]] = {name: [] for name in bench.batches}
    tokens: dict[str, int] = {}
    for _ in range(rounds):
        for name in bench.batches:
            tok_s, cpu_tok_s, tokens[name] = bench.run(name)
            runs[name].append(tok_s)
            cpu[name].append(cpu_tok_s)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpu.items()}
    return {
        "num_seqs": num_seqs,
        "num_constrained": num_seqs // 2,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "schema": SCHEMA,
        "tokens": tokens,
        "tok_s": {name: [round(v, 1) for v in values] for name, values in runs.items()},
        "median_tok_s": {name: round(v, 1) for name, v in medians.items()},
        "ratio": round(medians["half_constrained"] / medians["unconstrained"], 3),
        # By CPU time: what the grammars cost this thread, whatever else runs on the
        # machine (the wall clock counts the time other processes take the core).
        "median_cpu_tok_s": {name: round(v, 1) for name, v in cpu_medians.items()},
        "cpu_ratio": round(cpu_medians["half_constrained"] / cpu_medians["unconstrained"], 3),
    }


def _default_model() -> str:
    from iterserve.models import DEMO_MODEL_PATH

    if not (Path(DEMO_MODEL_PATH) / "config.json").exists():
        raise SystemExit(f"no checkpoint at {DEMO_MODEL_PATH}; pass --model")
    return str(DEMO_MODEL_PATH)
