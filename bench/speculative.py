"""``iterserve bench speculative``: decode tokens/s with prompt-lookup proposals
÷ without, at each batch size, with the acceptance rate beside every figure.

The real scheduler and one runner, in this process, one step at a time: the
same requests (prompts from the standard library's docstrings, the demo
tokenizer's, or random tokens with ``--random``) are generated to the end with
and without ``speculative_config``, alternating the two in each of ``rounds``
passes so that both see the same machine. Every request is in from the start
and decodes to ``max_tokens`` (greedy, EOS ignored): a batch of ``batch``
sequences that shrinks only as they finish together.

``--primed N`` continues each prompt from where the model's own greedy output
has reached: the prompt is the docstring followed by the model's first ``N``
tokens for it (generated once, without speculation, before anything is
timed). That is the input-grounded case speculation is for: the text to come
repeats what the prompt holds. The demo model's long greedy generations
repeat their own context; its first ~100 tokens rarely do, so unprimed runs
spend their first steps with proposals that do not land.

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
import math
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


def _generate(runner, prompts: list[list[int]], max_tokens: int, spec: dict | None,
              texts: dict[int, list[int]] | None = None) -> dict:  # fmt: skip
    """Every prompt to ``max_tokens``; CPU seconds of this thread and the counts
    (and each prompt's output tokens into ``texts``, by index, when given)."""
    num_blocks = sum(blocks_for(len(p) + max_tokens + 16, runner.block_size) for p in prompts) + 1
    config = SchedulerConfig(
        policy="chunked", max_num_seqs=len(prompts), max_num_batched_tokens=max(512, len(prompts)),
        max_model_len=max(len(p) for p in prompts) + max_tokens + 16,
        block_size=runner.block_size, num_kv_blocks=min(num_blocks, runner.num_kv_blocks),
        speculative_config=spec or {},
    )  # fmt: skip
    sched = Scheduler(config, ahead=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"b{i}", prompt, params))
    tokens = steps = 0
    start = time.thread_time()
    while sched.has_work:
        step = sched.schedule(0.0)
        assert step is not None
        for out in sched.update(runner.execute(step.plan)).outputs:
            tokens += len(out.new_token_ids)
            if texts is not None:
                texts.setdefault(int(out.request_id[1:]), []).extend(out.new_token_ids)
        steps += 1
    seconds = time.thread_time() - start
    stats = sched.spec_stats
    out: dict[str, Any] = {"tokens": tokens, "cpu_s": seconds, "steps": steps}
    if stats is not None:
        out["acceptance_rate"] = stats.num_accepted_tokens / max(1, stats.num_draft_tokens)
        out["tokens_per_draft"] = stats.num_emitted_tokens / max(1, stats.num_drafts)
        out["drafts"] = stats.num_drafts
    return out


def _primed(runner, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt followed by the model's first ``tokens`` greedy tokens for it."""
    if tokens <= 0:
        return prompts
    texts: dict[int, list[int]] = {}
    _generate(runner, prompts, tokens, None, texts)
    return [prompt + texts[i][:tokens] for i, prompt in enumerate(prompts)]


def _runner_options(prompts: list[list[int]], max_tokens: int, dtype: str) -> dict:
    """A runner's cache and context for every prompt generated to ``max_tokens``."""
    blocks = sum(blocks_for(len(p) + max_tokens + 16, 16) for p in prompts) + 1
    longest = max(len(p) for p in prompts) + max_tokens + 16
    return dict(dtype=dtype, num_kv_blocks=blocks, block_size=16, max_model_len=longest)


def _compare(plain_runner, spec_runner, prompts: list[list[int]], max_tokens: int, spec: dict,
             rounds: int, name: str) -> dict:  # fmt: skip
    """``rounds`` alternating runs without and with ``spec``: tokens/s medians, their
    ratio, and the last speculative run's acceptance (keys named ``name``)."""
    runs: dict[str, list[dict]] = {"plain": [], name: []}
    for _ in range(rounds):
        runs["plain"].append(_generate(plain_runner, prompts, max_tokens, None))
        runs[name].append(_generate(spec_runner, prompts, max_tokens, spec))
    rate = {k: statistics.median(r["tokens"] / r["cpu_s"] for r in v) for k, v in runs.items()}
    last = runs[name][-1]
    return {
        "batch": len(prompts),
        "plain_tok_s": round(rate["plain"], 1),
        f"{name}_tok_s": round(rate[name], 1),
        "ratio": round(rate[name] / rate["plain"], 2),
        "acceptance_rate": round(last.get("acceptance_rate", 0.0), 3),
        "tokens_per_draft": round(last.get("tokens_per_draft", 0.0), 2),
        "steps_plain": runs["plain"][-1]["steps"],
        f"steps_{name}": last["steps"],
    }


def bench_speculative(
    model: str | Path | None = None, *, batches=DEFAULT_BATCHES, max_tokens: int = 256,
    rounds: int = 3, num_speculative_tokens: int = 4, prompt_lookup_min: int = 2,
    prompt_lookup_max: int = 4, disable_by_batch_size: int | None = None,
    random_tokens: bool = False, dtype: str = "auto", threads: int = 1, seed: int = 0,
    primed: int = 0,
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
    runner = ModelRunner(path, **_runner_options(all_prompts, max_tokens + primed, dtype))
    runner.warm_up()
    all_prompts = _primed(runner, all_prompts, primed)
    rows = []
    for batch in batches:
        row = _compare(runner, runner, all_prompts[:batch], max_tokens, spec, rounds, "ngram")
        rows.append({**row, "speculating": batch <= limit})
        print(json.dumps(rows[-1]), flush=True)
    return {
        "model": str(path),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "workload": ("random tokens" if random_tokens else "stdlib docstrings")
        + (f", each followed by the model's first {primed} tokens for it" if primed else ""),
        "max_tokens": max_tokens,
        "rounds": rounds,
        "speculative_config": spec,
        "threads": threads,
        "rows": rows,
    }


def build_widened_target(
    draft: str | Path, out: str | Path, *, num_layers: int = 16, intermediate_size: int = 8192,
    noise: float = 0.0, seed: int = 0,
) -> Path:  # fmt: skip
    """A larger checkpoint that computes what ``draft`` computes, give or take
    ``noise``: the draft's layers first, their MLPs widened with random neurons
    whose output weights are ``noise``-sized, then random layers whose attention
    and MLP outputs are ``noise``-sized (0: they add nothing to the residual).
    A target of real size that a small draft can predict, for the draft-model
    benchmark; random weights throughout what is added."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    draft, out = Path(draft), Path(out)
    config = json.loads((draft / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.02):
        return torch.randn(*shape, generator=gen) * scale

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config.get(
        "head_dim", hidden // config["num_attention_heads"]
    )
    kv = config["num_key_value_heads"] * config.get("head_dim", q // config["num_attention_heads"])
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        for key in f.keys():
            tensors[key] = f.get_tensor(key).float()
    extra = intermediate_size - inter
    for i in range(config["num_hidden_layers"]):
        mlp = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj"):
            tensors[mlp + name + ".weight"] = torch.cat(
                [tensors[mlp + name + ".weight"], rand(extra, hidden)]
            )
        tensors[mlp + "down_proj.weight"] = torch.cat(
            [tensors[mlp + "down_proj.weight"], rand(hidden, extra, scale=noise)], dim=1
        )
    for i in range(config["num_hidden_layers"], num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "self_attn.q_proj.weight"] = rand(q, hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv, hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv, hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, q, scale=noise)
        tensors[p + "mlp.gate_proj.weight"] = rand(intermediate_size, hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(intermediate_size, hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden, intermediate_size, scale=noise)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config.update(num_hidden_layers=num_layers, intermediate_size=intermediate_size)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):  # fmt: skip
        if (draft / name).is_file():
            (out / name).write_bytes((draft / name).read_bytes())
    return out


def _num_params(checkpoint: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())


def bench_draft_model(
    *, batches=(1, 2, 4), max_tokens: int = 128, rounds: int = 2, num_speculative_tokens: int = 4,
    num_layers: int = 16, intermediate_size: int = 8192, noise: float = 0.02,
    dtype: str = "auto", threads: int = 1,
) -> dict:  # fmt: skip
    """Decode tokens/s with the demo model drafting for a larger target built from it
    (:func:`build_widened_target`) ÷ the target alone, by batch size."""
    import tempfile

    from ..models import DEMO_MODEL_PATH
    from ..workers.runner import ModelRunner

    torch.set_num_threads(threads)
    draft = Path(DEMO_MODEL_PATH)
    prompts_all = _prompts(draft, max(batches), False, 0)
    with tempfile.TemporaryDirectory() as tmp:
        target = build_widened_target(draft, Path(tmp) / "target", num_layers=num_layers,
                                      intermediate_size=intermediate_size, noise=noise)  # fmt: skip
        common = _runner_options(prompts_all, max_tokens, dtype)
        plain_runner = ModelRunner(target, **common)
        draft_runner = ModelRunner(target, draft_model=draft, **common)
        for r in (plain_runner, draft_runner):
            r.warm_up()
        params = _num_params(target)
        spec = {"method": "draft_model", "model": str(draft),
                "num_speculative_tokens": num_speculative_tokens,
                "disable_by_batch_size": max(batches)}  # fmt: skip
        rows = []
        for batch in batches:
            prompts = prompts_all[:batch]
            rows.append(_compare(plain_runner, draft_runner, prompts, max_tokens, spec, rounds,
                                 "draft"))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return {
        "target_params": params, "draft": str(draft), "noise": noise,
        "dtype": str(plain_runner.dtype).removeprefix("torch."),
        "max_tokens": max_tokens, "rounds": rounds, "speculative_config": spec, "rows": rows,
    }  # fmt: skip


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
    p.add_argument(
        "--primed",
        type=int,
        default=0,
        help="each prompt followed by the model's own first N greedy tokens for it",
    )
    p.add_argument(
        "--dtype", default="auto", help="the runners' (auto: bf16 on CPUs with bf16 instructions)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument(
        "--draft-model",
        action="store_true",
        help="the demo model drafting for a larger target built from it (--noise, --layers)",
    )
    p.add_argument("--noise", type=float, default=0.02, help="--draft-model: the target's")
    p.add_argument("--layers", type=int, default=16, help="--draft-model: the target's")
    p.add_argument("--json", help="also write the result to this file")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> None:
    if args.draft_model:
        result = bench_draft_model(
            batches=[int(b) for b in args.batches.split(",")], max_tokens=args.max_tokens,
            rounds=args.rounds, num_speculative_tokens=args.num_speculative_tokens,
            num_layers=args.layers, noise=args.noise, dtype=args.dtype, threads=args.threads,
        )  # fmt: skip
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return
    result = bench_speculative(
        args.model, batches=[int(b) for b in args.batches.split(",")], max_tokens=args.max_tokens,
        rounds=args.rounds, num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        disable_by_batch_size=args.disable_by_batch_size, random_tokens=args.random,
        dtype=args.dtype, threads=args.threads, primed=args.primed,
    )  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
