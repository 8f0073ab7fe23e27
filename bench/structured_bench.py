"""What structured outputs cost: decode throughput of a batch where half the
sequences follow a JSON schema, divided by the same batch unconstrained.

Both batches run through the real scheduler and the bare model runner in this
process (no Ray), so the difference is the grammars' own work on the rank:
filling each constrained row's bitmask from its matcher, applying the masks in
the sampler, advancing the matchers. The schema (a JSON list of at least 10 000
strings) never lets a sequence end before ``max_tokens``, so both batches
compute exactly the same number of tokens.

The two batches run side by side, each on a runner of its own, one step of one
then one step of the other (which goes first alternates): a slow stretch of
this shared machine then weighs on both alike, where two whole runs one after
the other would each meet a different one. Each round runs both batches to
their end; the figure is the median over rounds of their ratio. It prints
figures; it never asserts.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from ..scheduler import Request, SamplingParams, Scheduler
from ..scheduler.config import SchedulerConfig
from ..scheduler.sampling import StructuredOutput

SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 10_000}
BATCHES = ("unconstrained", "half_constrained")


class StructuredBench:
    def __init__(self, model: str, num_seqs: int, max_tokens: int, prompt_len: int = 16):
        import torch

        from ..workers.runner import ModelRunner

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
        self.runners = {
            name: ModelRunner(
                model,
                dtype="float32",
                num_kv_blocks=self.config.num_kv_blocks,
                block_size=block_size,
                kernel_backend="torch",
            )  # fmt: skip
            for name in BATCHES
        }
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

    def run(self) -> dict[str, tuple[float, float, int]]:
        """Both batches to their end, step by step side by side: per batch, tokens
        per second of its runner alone by the wall clock and by this thread's CPU
        time (the runner computes on it, one torch thread), and its tokens."""
        scheds = {}
        for name in BATCHES:
            scheds[name] = Scheduler(self.config)
            for i, (prompt, params) in enumerate(zip(self.prompts, self.batches[name])):
                scheds[name].add_request(Request(f"{name}-{i}", prompt, params))
        wall_s = dict.fromkeys(BATCHES, 0.0)
        cpu_s = dict.fromkeys(BATCHES, 0.0)
        tokens = dict.fromkeys(BATCHES, 0)
        turn = 0
        while any(sched.has_work for sched in scheds.values()):
            for name in BATCHES if turn % 2 == 0 else BATCHES[::-1]:
                sched = scheds[name]
                if not sched.has_work:
                    continue
                step = sched.schedule(time.monotonic())
                wall, cpu = time.perf_counter(), time.thread_time()
                result = self.runners[name].execute(step.plan)
                wall_s[name] += time.perf_counter() - wall
                cpu_s[name] += time.thread_time() - cpu
                tokens[name] += len(result.sampled)
                sched.update(result)
            turn += 1
        return {n: (tokens[n] / wall_s[n], tokens[n] / cpu_s[n], tokens[n]) for n in BATCHES}


def structured_cost(
    model: str | None = None, num_seqs: int = 16, max_tokens: int = 64, rounds: int = 5
) -> dict:
    bench = StructuredBench(model or _default_model(), num_seqs, max_tokens)
    bench.run()  # one-off costs: the grammar's compile, first allocations
    wall: dict[str, list[float]] = {name: [] for name in BATCHES}
    cpu: dict[str, list[float]] = {name: [] for name in BATCHES}
    tokens: dict[str, int] = {}
    for _ in range(rounds):
        for name, (tok_s, cpu_tok_s, num_tokens) in bench.run().items():
            wall[name].append(tok_s)
            cpu[name].append(cpu_tok_s)
            tokens[name] = num_tokens

    def ratio(runs: dict[str, list[float]]) -> float:
        """The median over rounds of constrained ÷ unconstrained, within each round."""
        pairs = zip(runs["half_constrained"], runs["unconstrained"])
        return round(statistics.median(a / b for a, b in pairs), 3)

    return {
        "num_seqs": num_seqs,
        "num_constrained": num_seqs // 2,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "schema": SCHEMA,
        "tokens": tokens,
        "tok_s": {name: [round(v, 1) for v in values] for name, values in wall.items()},
        "median_tok_s": {n: round(statistics.median(v), 1) for n, v in wall.items()},
        "ratio": ratio(wall),
        # By CPU time: what the grammars cost this thread, less moved by whatever
        # else runs on the machine (the wall clock counts the time others take).
        "median_cpu_tok_s": {n: round(statistics.median(v), 1) for n, v in cpu.items()},
        "cpu_ratio": ratio(cpu),
    }


def _default_model() -> str:
    from ..models import DEMO_MODEL_PATH

    if not (Path(DEMO_MODEL_PATH) / "config.json").exists():
        raise SystemExit(f"no checkpoint at {DEMO_MODEL_PATH}; pass --model")
    return str(DEMO_MODEL_PATH)
