"""How often two dtypes generate the same greedy text: bf16 against fp32.

``iterserve bench agreement [--model PATH] [--dtype bfloat16] [--against float32]``
runs the same prompts greedily through two runners of one checkpoint, one per
dtype, and prints how far their outputs agree: the share of sequences
identical to the end, the share of first tokens that agree, and the mean
position of the first difference. A bf16 forward differs from fp32 by about
half a percent per layer (tests/workers/test_bf16_numerics.py); greedy output
then follows fp32 until two candidates are closer than that, after which the
texts go their own ways. The prompts are the first lines of docstrings of
Python's own standard library (offline, and the text the demo model was
trained on); on a random-weight checkpoint the top candidates are near ties
and agreement says little.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from ..scheduler.blocks import blocks_for
from ..scheduler.messages import NewSequence, ScheduledSeq, StepPlan
from ..scheduler.sampling import SamplingParams
from ..workers.runner import ModelRunner

_MODULES = ("json", "os.path", "re", "collections", "itertools", "functools", "textwrap",
            "string", "pathlib", "shutil", "statistics", "random", "math", "heapq", "bisect",
            "copy")  # fmt: skip


def stdlib_prompts(count: int) -> list[str]:
    """The first line of the docstrings of ``count`` public standard-library functions."""
    prompts: list[str] = []
    for name in _MODULES:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            doc = getattr(getattr(module, attr), "__doc__", None)
            if attr.startswith("_") or not callable(getattr(module, attr)) or not doc:
                continue
            line = doc.strip().splitlines()[0].strip()
            if 20 <= len(line) <= 120 and not line.startswith(attr):
                prompts.append(line)
            if len(prompts) == count:
                return prompts
    return prompts


def greedy(runner: ModelRunner, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Every prompt prefilled in one step, then decoded together to ``max_tokens``."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    bs = runner.block_size
    out: list[list[int]] = [[] for _ in prompts]
    held = [0] * len(prompts)
    next_block = 0

    def entry(slot: int, start: int, n: int) -> ScheduledSeq:
        nonlocal next_block
        need = blocks_for(start + n, bs) - held[slot]
        held[slot] += need
        next_block += need
        return ScheduledSeq(slot, start, n, list(range(next_block - need, next_block)), sample=True)

    new = [NewSequence(i, f"a{i}", i, p, len(p), params) for i, p in enumerate(prompts)]
    plan = StepPlan(0, new_seqs=new, scheduled=[entry(i, 0, len(p)) for i, p in enumerate(prompts)])
    for step in range(max_tokens):
        for token in runner.execute(plan).sampled:
            out[token.seq_id].append(token.token_id)
        position = [len(p) + len(o) - 1 for p, o in zip(prompts, out, strict=True)]
        plan = StepPlan(step + 1, scheduled=[entry(i, position[i], 1) for i in range(len(prompts))])
    runner.execute(StepPlan(max_tokens + 1, released_slots=list(range(len(prompts)))))
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    firsts = []
    for x, y in zip(a, b, strict=True):
        firsts.append(
            next((i for i, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), len(x))
        )
    n = len(a)
    return {
        "sequences": n,
        "identical": round(sum(f == len(x) for f, x in zip(firsts, a, strict=True)) / n, 3),
        "first_token_agrees": round(sum(f > 0 for f in firsts) / n, 3),
        "mean_first_difference": round(statistics.mean(firsts), 1),
        "median_first_difference": statistics.median(firsts),
    }


def run(model: str | Path, dtype: str, against: str, num_prompts: int, max_tokens: int) -> dict:
    from ..workers.tokenizer import Tokenizer

    tokenizer = Tokenizer(model)
    texts = stdlib_prompts(num_prompts)
    prompts = [tokenizer.encode(t) for t in texts]
    blocks = sum(blocks_for(len(p) + max_tokens, 16) for p in prompts) + 1
    outputs = {}
    for name in (against, dtype):
        runner = ModelRunner(model, dtype=name, num_kv_blocks=blocks, block_size=16)
        outputs[name] = greedy(runner, prompts, max_tokens)
        del runner
    result = {"model": str(model), "dtype": dtype, "against": against, "max_tokens": max_tokens}
    result.update(agreement(outputs[dtype], outputs[against]))
    return result


def main(args: argparse.Namespace) -> None:
    from ..models import DEMO_MODEL_PATH

    torch.set_num_threads(args.threads or torch.get_num_threads())
    result = run(args.model or DEMO_MODEL_PATH, args.dtype, args.against, args.prompts,
                 args.tokens)  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "agreement", help="how often two dtypes generate the same greedy tokens"
    )
    p.add_argument("--model", help="checkpoint directory (default: the demo model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--against", default="float32")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--json", help="also write the result to this file")
    p.set_defaults(func=main)
    return p
