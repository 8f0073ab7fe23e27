"""``iterserve bench speculative``: decode tokens/s with prompt-lookup proposals
÷ without, at each batch size, with the acceptance rate beside every figure.

The real scheduler and one runner, in this process, one step at a time: the
same requests (prompts from the standard library's docstrings, the demo
tokenizer's, or random tokens with ``--random``) are generated to the end with
and without ``speculative_config``, alternating the two in each of ``rounds``
passes so that both see the same machine. Every request is in from the start
and decodes to ``max_tokens`` (greedy, EOS ignored): a batch of ``batch``
sequences that shrinks only as they finish together.

Time is the CPU time of this thread over the whole run (scheduling, proposing,
the forward, sampling and verifying: one torch thread runs every kernel on it),
so other load on a shared machine does not count; tokens/s is the output
tokens over it, and the ratio of the medians is printed from this one run.
Past ``disable_by_batch_size`` decoding sequences a step proposes nothing: the
largest batches show what that costs (the check that speculation off is free).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from ..scheduler.blocks import blocks_for

__all__ = ["bench_speculative", "register"]

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 64)


def _prompts(model: Path, count: int, random_tokens: bool, seed: int) -> list[list[int]]:
    from ..workers.tokenizer import Tokenizer
    from .agreement import stdlib_prompts

    tokenizer = Tokenizer(model)
    if random_tokens:
        rng = random.Random(seed)
        vocab = tokenizer.vocab_size
        return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))] for _ in range(count)]
    texts = stdlib_prompts(count)
    while len(texts) < count:  # more requests than docstrings: reuse them
        texts += texts[: count - len(texts)]
    return [tokenizer.encode(t) for t in texts]


def _generate(runner, prompts: list[list[int]], max_tokens: int, spec: dict | None) -> dict:
    """Every prompt to ``max_tokens``; CPU seconds of this thread and the counts."""
    num_blocks = sum(blocks_for(len(p) + max_tokens + 16, runner.block_size) for p in prompts) + 1
    config = SchedulerConfig(
        policy="chunked", max_num_seqs=len(prompts), max_num_batched_tokens=max(512, len(prompts)),
        max_model_len=max(len(p) for p in prompts) + max_tokens + 16,
        block_size=runner.block_size, num_kv_blocks=min(num_blocks, runner.num_kv_blocks),
        speculative_config=spec or {},
    )  # fmt: skip
    sched = Scheduler(config, max_in_flight=1)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"b{i}", prompt, params))
    tokens = steps = 0
    start = time.thread_time()
    while sched.has_work:
        step = sched.schedule(0.0)
        assert step is not None
        for out in sched.update(step, runner.execute(step.plan)):
            tokens += len(out.new_token_ids)
        steps += 1
    seconds = time.thread_time() - start
    stats = sched.spec_stats
    out: dict[str, Any] = {"tokens": tokens, "cpu_s": seconds, "steps": steps}
    if stats is not None:
        out["acceptance_rate"] = stats.num_accepted_tokens / max(1, stats.num_draft_tokens)
        out["tokens_per_draft"] = stats.num_emitted_tokens / max(1, stats.num_drafts)
        out["drafts"] = stats.num_drafts
    return out


def bench_speculative(
    model: str | Path | None = None, *, batches=DEFAULT_BATCHES, max_tokens: int = 256,
    rounds: int = 3, num_speculative_tokens: int = 4, prompt_lookup_min: int = 2,
    prompt_lookup_max: int = 4, disable_by_batch_size: int | None = None,
    random_tokens: bool = False, dtype: str = "float32", threads: int = 1, seed: int = 0,
) -> dict:  # fmt: skip
    """See the module docstring."""
    from ..models import DEMO_MODEL_PATH
    from ..scheduler.speculation import DEFAULT_DISABLE_BY_BATCH_SIZE
    from ..workers.runner import ModelRunner

    torch.set_num_threads(threads)
    path = Path(model or DEMO_MODEL_PATH)
    limit = disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE
    spec = {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_min": prompt_lookup_min, "prompt_lookup_max": prompt_lookup_max,
            "disable_by_batch_size": limit}  # fmt: skip
    all_prompts = _prompts(path, max(batches), random_tokens, seed)
    longest = max(len(p) for p in all_prompts) + max_tokens + 16
    blocks = sum(blocks_for(len(p) + max_tokens + 16, 16) for p in all_prompts) + 1
    runner = ModelRunner(path, dtype=dtype, num_kv_blocks=blocks, block_size=16,
                         max_model_len=longest)  # fmt: skip
    runner.warm_up()
    rows = []
    for batch in batches:
        prompts = all_prompts[:batch]
        runs: dict[str, list[dict]] = {"plain": [], "ngram": []}
        for _ in range(rounds):
            runs["plain"].append(_generate(runner, prompts, max_tokens, None))
            runs["ngram"].append(_generate(runner, prompts, max_tokens, spec))
        rate = {k: statistics.median(r["tokens"] / r["cpu_s"] for r in v) for k, v in runs.items()}
        last = runs["ngram"][-1]
        rows.append({
            "batch": batch,
            "plain_tok_s": round(rate["plain"], 1),
            "ngram_tok_s": round(rate["ngram"], 1),
            "ratio": round(rate["ngram"] / rate["plain"], 2),
            "acceptance_rate": round(last.get("acceptance_rate", 0.0), 3),
            "tokens_per_draft": round(last.get("tokens_per_draft", 0.0), 2),
            "steps_plain": runs["plain"][-1]["steps"],
            "steps_ngram": last["steps"],
            "speculating": batch <= limit,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return {
        "model": str(path),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "workload": "random tokens" if random_tokens else "stdlib docstrings",
        "max_tokens": max_tokens,
        "rounds": rounds,
        "speculative_config": spec,
        "threads": threads,
        "rows": rows,
    }


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``speculative`` to the ``iterserve bench`` sub-commands."""
    p = subparsers.add_parser(
        "speculative", help="decode tok/s with n-gram proposals ÷ without, by batch size"
    )
    p.add_argument("--model", help="checkpoint directory (default: the demo model)")
    p.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)),
                   help="comma-separated batch sizes")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--disable-by-batch-size", type=int, help="default: the engine's")
    p.add_argument("--random", action="store_true", help="random-token prompts")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", help="also write the result to this file")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> None:
    result = bench_speculative(
        args.model, batches=[int(b) for b in args.batches.split(",")], max_tokens=args.max_tokens,
        rounds=args.rounds, num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        disable_by_batch_size=args.disable_by_batch_size, random_tokens=args.random,
        dtype=args.dtype, threads=args.threads,
    )  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
