"""``iterserve bench lora``: what mixing LoRA adapters into a decode step costs.

One runner holds two sets of ``rows`` sequences with ``context`` cached tokens
each: one set on the base model, the other spread round-robin over
``num_adapters`` adapters (rank ``rank`` on every projection q/k/v/o/gate/up/
down, written in PEFT's layout into a temporary directory). Their decode steps
alternate, so that both see the same machine; the figure is the median over
``steps`` steps of each, timed by the CPU time of this thread over the whole
step (one torch thread runs every kernel on it, so a shared machine's other
load does not count, as ``bench forward``'s ``cpu_clock``), and the ratio of
the adapter step's tokens/s to the base step's is printed from that one run.

Four ways of adding the adapters are measured on the same steps:

- ``kernel`` (the default on a CPU, :mod:`iterserve.kernels.cpu.lora`): one
  compiled call per product, shrink and expand of every adapter's rows
  together; left out where numba or the dtype does not allow it;
- ``batched``: one batched shrink and one batched expand per product for all
  the step's adapters, through torch;
- ``segments``: each adapter's rows (contiguous: the runner orders rows by
  adapter) as their own two products;
- ``gather``: each adapter's rows gathered from wherever the plan put them and
  scattered back, the way a server without row ordering would run them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..scheduler.blocks import blocks_for
from ..scheduler.messages import AdapterLoad, NewSequence, StepPlan
from ..scheduler.sampling import SamplingParams
from ..workers.lora import TARGETS, target_shape

__all__ = ["bench_lora_serving", "bench_lora_step", "write_random_adapter"]


def write_random_adapter(path: Path, config, rank: int, seed: int,
                         targets: tuple[str, ...] = TARGETS) -> Path:  # fmt: skip
    """A random LoRA adapter of ``config``'s model in PEFT's on-disk layout."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target in targets:
            out_dim, in_dim = target_shape(config, target)
            part = "self_attn" if target in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_dim, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(targets), "bias": "none"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config_json))
    return path


class _GatherBatch:
    """Each adapter's rows gathered by index and scattered back (the baseline)."""

    def __init__(self, slots, rows_by_slot: dict[int, torch.Tensor]):
        self.parts = [(slots.layers[slot], rows) for slot, rows in rows_by_slot.items()]

    def add(self, layer, group, x, out) -> None:
        for layers, rows in self.parts:
            product = layers[layer].get(group)
            if product is not None:
                delta = torch.mm(torch.mm(x.index_select(0, rows), product.at), product.bt)
                out.index_add_(0, rows, delta)


def bench_lora_step(model_path: str | Path | None = None, *, rows: int = 64,
                    num_adapters: int = 4, rank: int = 16, context: int = 128,
                    steps: int = 20, num_threads: int | None = 1, dtype: str = "auto",
                    targets: tuple[str, ...] = TARGETS) -> dict[str, Any]:  # fmt: skip
    """Decode tokens/s of a ``rows``-row step over ``num_adapters`` adapters and of
    the same step on the base model, and their ratios (see the module docstring)."""
    from ..workers.runner import ModelRunner

    saved = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if model_path is None:
                from ..models import DEMO_MODEL_PATH

                model_path = DEMO_MODEL_PATH
            block_size = 16
            per_seq = blocks_for(context + steps * 4 + 2, block_size)
            runner = ModelRunner(model_path, num_kv_blocks=2 * rows * per_seq + 8,
                                 block_size=block_size, max_loras=num_adapters, dtype=dtype,
                                 max_lora_rank=max(rank, 16))  # fmt: skip
            loads = [
                AdapterLoad(i + 1, i + 1, f"a{i}", str(write_random_adapter(
                    Path(tmp) / f"a{i}", runner.config, rank, i, targets)))
                for i in range(num_adapters)
            ]  # fmt: skip
            out = _measure(runner, loads, rows, num_adapters, context, steps, block_size,
                           per_seq, str(model_path), rank)  # fmt: skip
            out["targets"] = ",".join(t.removesuffix("_proj") for t in targets)
            return out
    finally:
        torch.set_num_threads(saved)


def _measure(runner, loads, rows, num_adapters, context, steps, block_size, per_seq, name,
             rank):  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    state = {"step": 0, "computed": {}}
    blocks = {}

    def plan(new, slots, n, loads=()) -> StepPlan:
        from ..scheduler.messages import ScheduledSeq

        scheduled = []
        for s in slots:
            start = state["computed"].get(s, 0)
            have = blocks.setdefault(s, [])
            need = blocks_for(start + n, block_size) - len(have)
            fresh = list(range(s * per_seq + len(have), s * per_seq + len(have) + need))
            have += fresh
            state["computed"][s] = start + n
            scheduled.append(ScheduledSeq(s, start, n, fresh, sample=start + n > context))
        state["step"] += 1
        return StepPlan(state["step"], new_seqs=new, scheduled=scheduled,
                        adapter_loads=list(loads))  # fmt: skip

    def prompt() -> list[int]:
        return torch.randint(0, runner.vocab_size, (context + 1,), generator=gen).tolist()

    base_slots = list(range(rows))
    lora_slots = list(range(rows, 2 * rows))
    adapter_of = {s: 1 + i % num_adapters for i, s in enumerate(lora_slots)}  # interleaved
    for i, slots in enumerate((base_slots, lora_slots)):
        for first in range(0, rows, 16):
            chunk = slots[first : first + 16]
            new = [NewSequence(s, f"s{s}", s, prompt(), context + 1, params,
                               lora_slot=adapter_of.get(s, 0)) for s in chunk]  # fmt: skip
            runner.execute(plan(new, chunk, context, loads if i and not first else ()))

    lora = runner.lora_slots
    # mode -> (use_cpu_kernel, batch_adapters); gather: rows left where the plan put them
    modes: dict[str, tuple[bool, bool] | None] = {"kernel": (True, True),
                                                  "batched": (False, True),
                                                  "segments": (False, False), "gather": None}  # fmt: skip
    if lora.cpu_layout is None:
        del modes["kernel"]
    times: dict[str, list[float]] = {"base": [], **{m: [] for m in modes}}
    by_adapter = runner._by_adapter
    gather_rows = {a: torch.tensor([i for i, s in enumerate(lora_slots) if adapter_of[s] == a])
                   for a in range(1, num_adapters + 1)}  # fmt: skip

    def timed(p: StepPlan) -> float:
        start = time.thread_time()
        runner.execute(p)
        return time.thread_time() - start

    for _ in range(steps + 1):
        times["base"].append(timed(plan([], base_slots, 1)))
        for mode, flags in modes.items():
            if flags is None:  # rows left where the plan put them
                runner._by_adapter = lambda p: (p, [(0, 0, 0)])
                lora.batch = lambda segments: _GatherBatch(lora, gather_rows)
            else:
                lora.use_cpu_kernel, lora.batch_adapters = flags
            try:
                times[mode].append(timed(plan([], lora_slots, 1)))
            finally:
                runner._by_adapter = by_adapter
                lora.__dict__.pop("batch", None)
                lora.use_cpu_kernel, lora.batch_adapters = lora.cpu_layout is not None, True
    tok_s = {mode: rows / statistics.median(t[1:]) for mode, t in times.items()}
    out: dict[str, Any] = {"model": name, "rows": rows, "adapters": num_adapters, "rank": rank,
                           "context": context,
                           "num_threads": torch.get_num_threads(), "dtype": str(runner.dtype)}  # fmt: skip
    out.update({f"{mode}_tok_s": round(v, 1) for mode, v in tok_s.items()})
    out.update({f"{mode}_vs_base": round(tok_s[mode] / tok_s["base"], 3) for mode in modes})
    if "kernel" in tok_s:
        out["kernel_vs_gather"] = round(tok_s["kernel"] / tok_s["gather"], 3)
    out["batched_vs_gather"] = round(tok_s["batched"] / tok_s["gather"], 3)
    out["segments_vs_gather"] = round(tok_s["segments"] / tok_s["gather"], 3)
    return out


def main(args: argparse.Namespace) -> None:
    if args.serving:
        result = bench_lora_serving(args.model, num_adapters=args.adapters or 8,
                                    max_loras=args.max_loras, rank=args.rank,
                                    rounds=args.rounds)  # fmt: skip
    else:
        result = bench_lora_step(args.model, rows=args.rows, num_adapters=args.adapters or 4,
                                 rank=args.rank, steps=args.steps, num_threads=args.threads,
                                 dtype=args.dtype, targets=_targets(args.targets))  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


def _targets(text: str) -> tuple[str, ...]:
    names = tuple(f"{t.strip()}_proj" for t in text.split(",") if t.strip())
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise SystemExit(f"--targets: among q,k,v,o,gate,up,down, got {text!r}")
    return names


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``lora`` to the ``iterserve bench`` sub-commands."""
    p = subparsers.add_parser(
        "lora", help="decode tok/s of a step mixing LoRA adapters ÷ the base model's"
    )
    p.add_argument("--model", help="checkpoint directory (default: the demo model)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--adapters", type=int, help="adapters (default: 4 in a step, 8 serving)")
    p.add_argument(
        "--serving",
        action="store_true",
        help="engine output tok/s with requests over the adapters ÷ on the base model",
    )
    p.add_argument("--max-loras", type=int, default=8, help="adapter slots (--serving)")
    p.add_argument("--rounds", type=int, default=3, help="alternating passes (--serving)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--dtype", default="auto", help="the runner's dtype (step bench)")
    p.add_argument(
        "--targets",
        default="q,k,v,o,gate,up,down",
        help="adapted projections (step bench; peft's default for Llama: q,v)",
    )
    p.add_argument("--json", help="also write the result to this file")
    p.set_defaults(func=main)
    return p


# -- serving -------------------------------------------------------------------------------


def bench_lora_serving(model: str | None = None, *, num_requests: int = 64,
                       num_adapters: int = 8, max_loras: int = 8, rank: int = 16,
                       prompt_len: int = 32, max_tokens: int = 64, rounds: int = 3,
                       torch_threads: int = 1) -> dict[str, Any]:  # fmt: skip
    """Output tokens/s of one engine (through Ray, the real scheduler) serving
    ``num_requests`` requests at once spread round-robin over ``num_adapters``
    adapters, and the same requests on the base model, in ``rounds`` alternating
    passes; the medians and their ratio."""
    import asyncio

    from ..cluster.config import EngineConfig
    from ..cluster.engine import AsyncEngine
    from ..workers.checkpoint import load_checkpoint
    from .engine_bench import ensure_ray

    if model is None:
        from ..models import DEMO_MODEL_PATH

        model = str(DEMO_MODEL_PATH)
    ensure_ray()
    block_size = 16
    config = EngineConfig.from_dict(dict(
        model=model, num_kv_blocks=max(num_requests * (blocks_for(prompt_len + max_tokens,
                                                                   block_size) + 1),
                                       blocks_for(512, block_size)),
        max_num_seqs=num_requests, max_num_batched_tokens=max(512, num_requests),
        max_model_len=512, torch_threads=torch_threads, num_cpus_per_worker=1.0,
        enable_lora=True, max_loras=max_loras, max_lora_rank=max(16, rank),
        enable_prefix_caching=False,
    ))  # fmt: skip
    ckpt = load_checkpoint(model)
    model_config = ckpt.config
    ckpt.close()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [[10 + (i * 7 + j) % 300 for j in range(prompt_len)] for i in range(num_requests)]

    async def one_pass(engine, names) -> float:
        async def one(i, prompt):
            n = 0
            async for out in engine.generate(prompt, params, lora_name=names[i % len(names)]):
                n += len(out.token_ids)
            return n

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return sum(counts) / (time.perf_counter() - start)

    async def run(tmp: str) -> dict[str, list[float]]:
        engine = await AsyncEngine(config).start()
        try:
            names = []
            for i in range(num_adapters):
                path = write_random_adapter(Path(tmp) / f"a{i}", model_config, rank, 100 + i)
                refusal = await engine.actor.load_lora_adapter.remote(f"a{i}", str(path))
                assert refusal is None, refusal
                names.append(f"a{i}")
            runs: dict[str, list[float]] = {"base": [], "lora": []}
            await one_pass(engine, [None])  # warm-up: every adapter loaded once too
            await one_pass(engine, names)
            for _ in range(rounds):
                runs["base"].append(await one_pass(engine, [None]))
                runs["lora"].append(await one_pass(engine, names))
            return runs
        finally:
            await engine.shutdown()

    with tempfile.TemporaryDirectory() as tmp:
        runs = asyncio.run(run(tmp))
    base, lora = statistics.median(runs["base"]), statistics.median(runs["lora"])
    return {
        "model": model, "requests": num_requests, "adapters": num_adapters,
        "max_loras": max_loras, "rank": rank, "max_tokens": max_tokens,
        "base_tok_s": round(base, 1), "lora_tok_s": round(lora, 1),
        "lora_vs_base": round(lora / base, 3),
        "base_tok_s_runs": [round(x, 1) for x in runs["base"]],
        "lora_tok_s_runs": [round(x, 1) for x in runs["lora"]],
    }  # fmt: skip
