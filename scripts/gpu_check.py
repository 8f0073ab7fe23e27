#!/usr/bin/env python3
"""One device check of the GPU decode path: correctness first, then speed.

    python scripts/gpu_check.py --json out.json     # on a GPU, from the repository root
    python scripts/gpu_check.py --smoke              # on the CPU, Triton interpreted, tiny shapes

Needs only torch and triton: the ``iterserve`` package is mapped onto this
checkout (pyproject maps ``iterserve.kernels`` to ``kernels/`` and so on),
so nothing has to be installed. Prints one line per figure and writes them
all as JSON:

1. ``device``: what ran, and ``copy_ceiling_gbps``, the device-to-device copy
   bandwidth (bytes read + written per second), the practical HBM ceiling;
2. ``kernels``: every kernel against its torch reference (bf16 and fp16,
   head_dim 128, 32/8 heads, block 16): decode at batch 1 and 64 up to 8k
   context, split counts forced, the decode graphs' wide tables, a mixed
   batch, a cache of more than 2^31 elements;
3. ``attention``: paged attention bandwidth (K/V bytes / kernel time) as a
   fraction of the copy ceiling over a grid of (batch, context);
4. ``model``: an 8B-shaped Llama with random weights built on the device:
   Triton logits against the torch references', graph replay against eager,
   then decode tok/s and MBU eager and graph-replayed at batch 1/8/32/64;
5. ``host``: host-side costs of building a batch and of sampling.

Exit status 1 on any correctness failure (or a section that raised). The
speed goals are reported (``goals``), not enforced.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC_BANDWIDTH = [  # (name substring, bytes/s): the vendor's HBM figure
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12),
]


def use_checkout() -> None:
    """``import iterserve.kernels`` etc. from this checkout, as pyproject's
    package-dir maps them, without installing anything."""
    pkg = types.ModuleType("iterserve")
    pkg.__path__ = [str(ROOT)]
    pkg.__version__ = "checkout"
    sys.modules["iterserve"] = pkg


class Report:
    def __init__(self, smoke: bool):
        self.data: dict = {"smoke": smoke, "failures": []}
        self.t0 = time.perf_counter()

    def put(self, section: str, key: str, value) -> None:
        self.data.setdefault(section, {})[key] = value
        shown = json.dumps(value) if not isinstance(value, float) else f"{value:.4g}"
        print(f"  {section}.{key} = {shown}", flush=True)

    def check(self, section: str, key: str, ok: bool, detail) -> None:
        self.put(section, key, {"ok": bool(ok), **detail})
        if not ok:
            self.data["failures"].append(f"{section}.{key}")

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


# ----------------------------------------------------------------------- timing


def gpu_seconds(fn, iters: int, device, warmup: int = 3) -> float:
    """Seconds per call of ``fn``: on CUDA, ``iters`` calls captured in one graph
    and replayed between events (launch overhead excluded), eager events if the
    capture fails; on the CPU, the wall clock."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        graph.replay()
        times = []
        for _ in range(3):
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1000 / iters)
        del graph
        return min(times)
    except RuntimeError:
        torch.cuda.synchronize()
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000 / iters


def free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------- device


def check_device(r: Report, dev, smoke: bool) -> float:
    import torch
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "device": str(dev)}
    peak = None
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(name=props.name, sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}")  # fmt: skip
        peak = next((bw for name, bw in SPEC_BANDWIDTH if name in props.name), None)
    for k, v in info.items():
        r.put("device", k, v)
    r.put("device", "spec_bandwidth_gbps", peak / 1e9 if peak else None)
    n = (64 << 20) if smoke else (2 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    seconds = gpu_seconds(lambda: dst.copy_(src), 5 if smoke else 20, dev)
    ceiling = 2 * n / seconds / 1e9
    r.put("device", "copy_ceiling_gbps", ceiling)
    return ceiling  # the buffers go with this frame


# ---------------------------------------------------------------------- kernels


def attention_case(torch, dev, dtype, shape, *, heads=32, kv_heads=8, head_dim=128,
                   block_size=16, width=None, high_blocks=0, seed=0):  # fmt: skip
    """A batch of (cached, new) pieces over a shuffled paged cache. ``high_blocks``
    puts every used block past that many unused ones (offsets beyond 2^31)."""
    from iterserve.scheduler.blocks import blocks_for

    g = torch.Generator(device=dev).manual_seed(seed)
    q_lens = [q for _, q in shape]
    seq_lens = [c + q for c, q in shape]
    per_seq = [blocks_for(n, block_size) for n in seq_lens]
    used = sum(per_seq)
    num_blocks = high_blocks + used + 4
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    # Zeroed: the reference reads (and masks) blocks past a sequence's own, and
    # an uninitialised NaN there would survive 0 * NaN.
    k_cache = torch.zeros(cache_shape, dtype=dtype, device=dev)
    v_cache = torch.zeros(cache_shape, dtype=dtype, device=dev)
    ids = high_blocks + torch.randperm(used + 4, generator=g, device=dev)[:used]
    k_cache[ids] = torch.randn((used, *cache_shape[1:]), generator=g, device=dev).to(dtype)
    v_cache[ids] = torch.randn((used, *cache_shape[1:]), generator=g, device=dev).to(dtype)
    cols = width or max(per_seq)
    tables = torch.zeros(len(shape), cols, dtype=torch.int32, device=dev)
    start = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = ids[start : start + n].to(torch.int32)
        start += n
    query = torch.randn(sum(q_lens), heads, head_dim, generator=g, device=dev).to(dtype)
    starts = torch.tensor([0] + q_lens, device=dev).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return (query, k_cache, v_cache, tables, lens, starts, head_dim**-0.5)


def check_kernels(r: Report, dev, smoke: bool) -> None:
    import torch

    from iterserve.kernels import (
        attention_plan,
        build_cos_sin_cache,
        triton_attention,
        triton_cache,
        triton_ops,
    )
    from iterserve.kernels import reference as ref

    tol = {
        torch.float32: dict(atol=1e-5, rtol=1e-5),
        torch.float16: dict(atol=2e-3, rtol=1e-2),
        torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    }
    dtypes = (torch.float32, torch.float16) if smoke else (torch.bfloat16, torch.float16)

    def compare(key, got, want, dtype):
        err = (got.float() - want.float()).abs()
        limit = tol[dtype]["atol"] + tol[dtype]["rtol"] * want.float().abs()
        ok = bool((err <= limit).all()) and bool(torch.isfinite(got.float()).all())
        r.check("kernels", key, ok, {"max_abs_err": float(err.max()) if err.numel() else 0.0})

    # (name, pieces, options): decode at batch 1 and 64 up to 8k, forced splits,
    # the graphs' wide table, a mixed batch.
    if smoke:
        geometry = dict(heads=4, kv_heads=2, head_dim=32, block_size=16)
        cases = [
            ("decode_b1", [(200, 1)], {}),
            ("decode_b4_split3", [(63, 1), (64, 1), (130, 1), (5, 1)], {"splits": 3}),
            ("decode_wide_table", [(40, 1), (70, 1)], {"width": 16}),
            ("mixed", [(37, 1), (21, 12), (9, 0), (0, 19), (5, 1)], {}),
        ]
    else:
        geometry = dict(heads=32, kv_heads=8, head_dim=128, block_size=16)
        gen = torch.Generator().manual_seed(0)
        ragged = [(int(c), 1) for c in torch.randint(1, 8192, (64,), generator=gen)]
        cases = [
            ("decode_b1_ctx1k", [(1023, 1)], {}),
            ("decode_b1_ctx8k", [(8191, 1)], {}),
            ("decode_b1_ctx8k_split7", [(8000, 1)], {"splits": 7}),
            ("decode_b64_ctx_to_8k", ragged, {}),
            ("decode_b8_graph_table", [(c, 1) for c in (5, 300, 2047, 4000, 1, 64, 65, 8191)],
             {"width": 512}),
            ("mixed", [(2047, 1), (1000, 1), (517, 300), (0, 512), (33, 1), (120, 0), (4000, 1),
                       (70, 3)], {}),
        ]  # fmt: skip
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for case, shape, opt in cases:
            args = attention_case(torch, dev, dtype, shape, width=opt.get("width"), **geometry)
            if "splits" in opt:
                tiles = attention_plan.tiles_for(
                    args[0].element_size(),
                    geometry["head_dim"],
                    geometry["heads"] // geometry["kv_heads"],
                )
                plan = attention_plan.AttentionPlan(tiles, opt["splits"], True, True)
                got = triton_attention.run_plan(plan, *args)
            elif "width" in opt:
                hint = opt["width"] * geometry["block_size"]
                got = triton_attention.paged_attention(*args, max_query_len=1, max_seq_len=hint)
            else:
                got = triton_attention.paged_attention(*args)
            compare(f"attention_{case}_{name}", got, ref.paged_attention(*args), dtype)
            del args, got
        free_memory()

        # A cache of more than 2^31 elements, its sequences at the far end.
        if not smoke:
            per_block = geometry["block_size"] * geometry["kv_heads"] * geometry["head_dim"]
            high = (1 << 31) // per_block + 8
            args = attention_case(torch, dev, dtype, [(4000, 1), (3000, 1), (100, 200), (8, 1)],
                                  high_blocks=high, **geometry)  # fmt: skip
            r.put("kernels", f"big_cache_elements_{name}", args[1].numel())
            compare(f"attention_cache_over_2e31_{name}", triton_attention.paged_attention(*args),
                    ref.paged_attention(*args), dtype)  # fmt: skip
            q, k_cache, v_cache = args[0], args[1], args[2]
            slots = (high * geometry["block_size"]
                     + torch.randperm(4096, device=dev)[: q.shape[0]]).to(torch.int32)  # fmt: skip
            key = q[:, : geometry["kv_heads"]]
            ref_k, ref_v = k_cache.clone(), v_cache.clone()
            triton_cache.store_kv(key, key, k_cache, v_cache, slots)
            ref.store_kv(key, key, ref_k, ref_v, slots)
            same = torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
            r.check("kernels", f"store_kv_cache_over_2e31_{name}", same, {})
            del args, q, k_cache, v_cache, ref_k, ref_v, key
            free_memory()

        # The per-token ops at serving sizes.
        tokens, hidden, inter = (64, 64, 96) if smoke else (4096, 4096, 14336)
        heads, kv_heads, head_dim = (4, 2, 32) if smoke else (32, 8, 128)
        g = torch.Generator(device=dev).manual_seed(1)

        def randn(*shape, g=g, dtype=dtype):
            return torch.randn(*shape, generator=g, device=dev).to(dtype)

        x, res, w = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
        compare(f"rms_norm_{name}", triton_ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5),
                dtype)  # fmt: skip
        got, want = triton_ops.rms_norm(x, w, 1e-5, res), ref.rms_norm(x, w, 1e-5, res)
        compare(f"rms_norm_residual_{name}", got[0], want[0], dtype)
        gate_up = randn(tokens, 2 * inter)
        compare(f"silu_mul_{name}", triton_ops.silu_mul(gate_up), ref.silu_mul(gate_up), dtype)
        cos_sin = build_cos_sin_cache(head_dim, 8192, 500000.0).to(dev)
        positions = torch.randint(0, 8192, (tokens,), generator=g, device=dev)
        qkv = randn(tokens, heads + 2 * kv_heads, head_dim)
        q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
        got = triton_ops.rotary_embedding(positions, q, k, cos_sin)
        want = ref.rotary_embedding(positions, q, k, cos_sin)
        compare(f"rotary_{name}", torch.cat([got[0], got[1]], 1),
                torch.cat([want[0], want[1]], 1), dtype)  # fmt: skip
        caches = [torch.zeros(600, 16, kv_heads, head_dim, dtype=dtype, device=dev) for _ in "kvKV"]
        slots = torch.randperm(600 * 16, generator=g, device=dev)[:tokens].to(torch.int32)
        slots[::7] = -1
        value = qkv[:, heads + kv_heads :]
        triton_cache.store_kv(k, value, caches[0], caches[1], slots)
        ref.store_kv(k, value, caches[2], caches[3], slots)
        same = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        r.check("kernels", f"store_kv_{name}", same, {})
        free_memory()


# -------------------------------------------------------------------- attention


def check_attention_bandwidth(r: Report, dev, smoke: bool, ceiling: float) -> None:
    import torch

    from iterserve.kernels import attention_plan, triton_attention

    dtype = torch.float32 if smoke else torch.bfloat16
    geometry = dict(heads=4, kv_heads=2, head_dim=32) if smoke else {}
    grid = [(1, 128), (4, 256)] if smoke else [
        (b, c) for b in (1, 8, 32, 64, 128) for c in (1024, 4096, 8192)
    ]  # fmt: skip
    rows = []
    for batch, context in grid:
        args = attention_case(torch, dev, dtype, [(context - 1, 1)] * batch, **geometry)
        _, _, kv_heads, head_dim = args[1].shape
        kv_bytes = 2 * batch * context * kv_heads * head_dim * args[1].element_size()
        seconds = gpu_seconds(lambda a=args: triton_attention.paged_attention(*a, max_query_len=1),
                              3 if smoke else 20, dev)  # fmt: skip
        gbps = kv_bytes / seconds / 1e9
        row = {"batch": batch, "context": context, "us": seconds * 1e6, "gbps": gbps,
               "fraction_of_ceiling": gbps / ceiling}  # fmt: skip
        if batch == 1:  # what the split buys: the same call with one split
            tiles = attention_plan.tiles_for(args[0].element_size(), args[0].shape[2],
                                             args[0].shape[1] // args[1].shape[2])  # fmt: skip
            plan = attention_plan.AttentionPlan(tiles, 1, True, False)
            one = gpu_seconds(lambda a=args, p=plan: triton_attention.run_plan(p, *a),
                              3 if smoke else 20, dev)  # fmt: skip
            row["no_split_fraction_of_ceiling"] = kv_bytes / one / 1e9 / ceiling
        rows.append(row)
        print(f"  attention b={batch:<4d} ctx={context:<5d} {seconds * 1e6:8.1f} us "
              f"{gbps:7.0f} GB/s  {gbps / ceiling:5.1%} of ceiling", flush=True)  # fmt: skip
        del args
        free_memory()
    r.data["attention"] = {"grid": rows}


# ------------------------------------------------------------------------ model


def model_config(smoke: bool):
    from iterserve.workers.config import ModelConfig

    if smoke:
        return ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                           intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                           max_position_embeddings=512, eos_token_ids=(2,))  # fmt: skip
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=8192, eos_token_ids=(128001,))  # fmt: skip


class Sequences:
    """Plans for a runner: sequences whose KV is taken as already cached (the
    contents do not change the time), each decoding one token per step."""

    def __init__(self, runner, count: int, context: int):
        from iterserve.scheduler.blocks import blocks_for
        from iterserve.scheduler.messages import NewSequence, StepPlan
        from iterserve.scheduler.sampling import SamplingParams

        self.runner, self.step = runner, 0
        bs = runner.block_size
        params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
        new = [NewSequence(i, f"s{i}", i, [1] * (context + 1), context + 1, params)
               for i in range(count)]  # fmt: skip
        runner.execute(StepPlan(self.next_step(), new_seqs=new))
        self.next_block = 0
        for i in range(count):
            seq = runner.table.get(i)
            need = blocks_for(context + 1, bs)
            seq.block_ids = list(range(self.next_block, self.next_block + need))
            self.next_block += need
            seq.num_computed_tokens = context

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def decode(self, count: int):
        from iterserve.scheduler.messages import ScheduledSeq, StepPlan

        bs = self.runner.block_size
        entries = []
        for i in range(count):
            seq = self.runner.table.get(i)
            pos = seq.num_computed_tokens
            new = []
            if (pos + 1) > len(seq.block_ids) * bs:
                new = [self.next_block]
                self.next_block += 1
            entries.append(ScheduledSeq(i, pos, 1, new, sample=True))
        return self.runner.execute(StepPlan(self.next_step(), scheduled=entries))


def check_model(r: Report, dev, smoke: bool, ceiling: float, peak: float | None) -> None:
    import torch

    from iterserve.kernels import get_ops
    from iterserve.scheduler.blocks import blocks_for
    from iterserve.scheduler.messages import NewSequence, ScheduledSeq, StepPlan
    from iterserve.scheduler.sampling import SamplingParams
    from iterserve.workers.batch import layout_batch
    from iterserve.workers.model import weight_bytes
    from iterserve.workers.runner import ModelRunner

    config = model_config(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    batches = (1, 4) if smoke else (1, 8, 32, 64)
    context = 64 if smoke else 1024
    steps = 4 if smoke else 24
    bs = 16
    gen = torch.Generator().manual_seed(0)
    lens = (40, 17) if smoke else (700, 129)
    # Decoding sequences take blocks from 0 up, each growing by every step it runs
    # (3 warm-up + `steps`, eager and replayed, at each batch size); the logits
    # check's two prompts take theirs from the top.
    growth = len(batches) * 2 * (3 + steps)
    decode_blocks = max(batches) * blocks_for(context + 1 + growth, bs)
    prompt_blocks = sum(blocks_for(n + 2, bs) for n in lens)
    blocks = decode_blocks + prompt_blocks
    start = time.perf_counter()
    runner = ModelRunner.from_config(config, dtype=dtype, device=dev, num_kv_blocks=blocks,
                                     block_size=bs, kernel_backend="triton", cuda_graphs=True,
                                     graph_batch_sizes=batches)  # fmt: skip
    r.put("model", "build_and_capture_s", time.perf_counter() - start)
    weights = weight_bytes(config, dtype)
    r.put("model", "weight_gib", weights / 2**30)

    # 1. Triton logits against the torch references', same weights, same batch:
    #    two prompts in one step, then a decode step of both.
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    slot0 = 1000
    new = [
        NewSequence(slot0 + i, f"p{i}", slot0 + i, p, len(p), params) for i, p in enumerate(prompts)
    ]
    tables, nb = [], decode_blocks
    for p in prompts:
        n = blocks_for(len(p) + 2, bs)
        tables.append(list(range(nb, nb + n)))
        nb += n
    entries = [ScheduledSeq(slot0 + i, 0, len(p), tables[i], sample=True)
               for i, p in enumerate(prompts)]  # fmt: skip
    plan = runner.table.apply(StepPlan(10_000, new_seqs=new, scheduled=entries))
    triton_ops, torch_ops = runner.ops, get_ops("torch")

    def logits_of(host, ops):
        runner.model.set_ops(ops)
        try:
            return runner.forward(host).float()
        finally:
            runner.model.set_ops(triton_ops)

    def layout(plan):
        return layout_batch(plan, runner.table, block_size=bs,
                            scratch_block=runner.kv_cache.scratch_block, pad_token_id=0,
                            max_position=config.max_position_embeddings)  # fmt: skip

    def agree(key, got, want, rel_limit):
        rel = float((got - want).norm() / want.norm())
        cos = float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), 0))
        top1 = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        r.check("model", key, rel <= rel_limit and cos >= 0.995,
                {"rel_err": rel, "cosine": cos, "top1_agreement": top1})  # fmt: skip

    saved_graphs, runner.graphs = runner.graphs, None  # eager for the prefill step
    host = layout(plan)
    want = logits_of(host, torch_ops)
    got = logits_of(host, triton_ops)
    agree("prefill_logits_triton_vs_torch", got, want, 0.05)
    for e in plan.scheduled:
        runner.table.advance(e)
    for i, tok in enumerate(want.argmax(-1).tolist()):
        runner.table.append_token(slot0 + i, tok)
    decode = runner.table.apply(StepPlan(10_001, scheduled=[
        ScheduledSeq(slot0 + i, len(p), 1, [], sample=True) for i, p in enumerate(prompts)
    ]))  # fmt: skip
    host = layout(decode)
    want = logits_of(host, torch_ops)
    eager = logits_of(host, triton_ops)
    agree("decode_logits_triton_vs_torch", eager, want, 0.05)
    runner.graphs = saved_graphs
    replayed = runner.forward(host).float()
    r.put("model", "decode_step_replayed", saved_graphs.replayable(host))
    agree("decode_logits_graph_vs_eager", replayed, eager, 0.02)
    runner.execute(StepPlan(10_002, released_slots=[slot0 + i for i in range(len(prompts))]))
    del want, got, eager, replayed
    free_memory()

    # 2. Decode tok/s and MBU, eager and graph-replayed, at `context` tokens cached.
    seqs = Sequences(runner, max(batches), context)
    layer_kv = (
        2 * config.num_kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()
    )
    rows = []
    for batch in batches:
        row = {"batch": batch, "context": context}
        for mode in ("eager", "graphs"):
            runner.graphs = None if mode == "eager" else saved_graphs
            for _ in range(3):
                seqs.decode(batch)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            walls, forwards = [], []
            for _ in range(steps):
                t = time.perf_counter()
                result = seqs.decode(batch)
                walls.append(time.perf_counter() - t)
                forwards.append(result.forward_s)
            wall, fwd = statistics.median(walls), statistics.median(forwards)
            ctx_now = runner.table.get(0).num_computed_tokens
            step_bytes = weights + batch * ctx_now * config.num_layers * layer_kv
            row[f"{mode}_tok_s"] = batch / wall
            row[f"{mode}_step_ms"] = wall * 1e3
            row[f"{mode}_forward_ms"] = fwd * 1e3
            row[f"{mode}_mbu_vs_copy_ceiling"] = step_bytes / wall / (ceiling * 1e9)
            if peak:
                row[f"{mode}_mbu"] = step_bytes / wall / peak
        row["graphs_over_eager"] = row["graphs_tok_s"] / row["eager_tok_s"]
        rows.append(row)
        print(f"  model decode b={batch:<3d} eager {row['eager_tok_s']:9.1f} tok/s "
              f"graphs {row['graphs_tok_s']:9.1f} tok/s  x{row['graphs_over_eager']:.2f}  "
              f"MBU {row.get('graphs_mbu', row['graphs_mbu_vs_copy_ceiling']):.1%}",
              flush=True)  # fmt: skip
    runner.graphs = saved_graphs
    r.data.setdefault("model", {})["decode"] = rows
    r.put("model", "graph_replays", saved_graphs.num_replays)


# ------------------------------------------------------------------------- host


class Row:
    def __init__(self, seq_id, params, token_ids, num_prompt_tokens):
        self.seq_id, self.params = seq_id, params
        self.token_ids, self.num_prompt_tokens = token_ids, num_prompt_tokens
        self.counts_row, self.counted = -1, (0, -1)  # its token-count row, as a SeqState's


def check_host(r: Report, dev, smoke: bool) -> None:
    import torch

    from iterserve.scheduler.blocks import blocks_for
    from iterserve.scheduler.messages import NewSequence, ScheduledSeq, StepPlan
    from iterserve.scheduler.sampling import SamplingParams
    from iterserve.scheduler.seq_table import SequenceTable
    from iterserve.workers.batch import Staging, build_batch
    from iterserve.workers.sampler import Sampler

    num_seqs, context = 64, (256 if smoke else 2048)
    table = SequenceTable()
    params = SamplingParams(temperature=0.0)
    new = [NewSequence(i, f"h{i}", i, [1] * (context + 1), context + 1, params)
           for i in range(num_seqs)]  # fmt: skip
    table.apply(StepPlan(0, new_seqs=new))
    per = blocks_for(context + 1, 16)
    for i in range(num_seqs):
        seq = table.get(i)
        seq.block_ids = list(range(i * per, (i + 1) * per))
        seq.num_computed_tokens = context
    plan = StepPlan(1, scheduled=[ScheduledSeq(i, context, 1, [], sample=True)
                                  for i in range(num_seqs)])  # fmt: skip
    staging = Staging(dev) if dev.type == "cuda" else None
    kw = dict(block_size=16, scratch_block=num_seqs * per, pad_token_id=0, max_position=1 << 20,
              device=dev, staging=staging)  # fmt: skip
    times = []
    for _ in range(30):
        t = time.perf_counter()
        build_batch(plan, table, **kw)
        times.append(time.perf_counter() - t)
    r.put("host", f"build_batch_ms_{num_seqs}x{context}", statistics.median(times[5:]) * 1e3)

    vocab = 256 if smoke else 128256
    sampler = Sampler(frozenset({2}), dev, seed=0)
    logits = torch.randn(num_seqs, vocab, device=dev)

    def rows_with(p):
        return [Row(i, p, [1, 2, 3] * 50, 100) for i in range(num_seqs)]

    for name, p in {
        "greedy": SamplingParams(temperature=0.0),
        "temperature": SamplingParams(temperature=0.8),
        "top_k_50": SamplingParams(temperature=0.8, top_k=50),
        "top_p_0.9": SamplingParams(temperature=0.8, top_p=0.9),
        "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.2,
                                    frequency_penalty=0.3, presence_penalty=0.3),
        "logprobs_5": SamplingParams(temperature=0.8, logprobs=5),
    }.items():  # fmt: skip
        rows = rows_with(p)
        times = []
        for _ in range(12):
            t = time.perf_counter()
            out = sampler(logits, rows)
            times.append(time.perf_counter() - t)
            for row, token in zip(rows, out.token_ids):  # as the runner's table does
                row.token_ids.append(token)
        r.put("host", f"sample_ms_{name}_b{num_seqs}", statistics.median(times[2:]) * 1e3)


# ------------------------------------------------------------------------ goals


def goals(r: Report) -> None:
    out = {}
    decode = {row["batch"]: row for row in r.data.get("model", {}).get("decode", [])}
    if 1 in decode and "graphs_mbu" in decode[1]:
        out["decode_mbu_b1_ctx1k_graphs>=0.70"] = decode[1]["graphs_mbu"]
    host_bound = [row["graphs_over_eager"] for b, row in decode.items() if b <= 8]
    if host_bound:
        out["graphs_over_eager_small_batch>=1.15"] = max(host_bound)
    grid = r.data.get("attention", {}).get("grid", [])
    wide = [row["fraction_of_ceiling"] for row in grid if row["batch"] >= 64]
    if wide:
        out["attention_b>=64_fraction>=0.60"] = min(wide)
    long1 = [row["fraction_of_ceiling"] for row in grid if row["batch"] == 1
             and row["context"] == 8192]  # fmt: skip
    if long1:
        out["attention_b1_ctx8k_fraction>=0.40"] = long1[0]
    for key, value in out.items():
        limit = float(key.rsplit(">=", 1)[1])
        r.put("goals", key, {"value": value, "met": value >= limit})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, Triton interpreted, tiny shapes (what CI runs)")  # fmt: skip
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    use_checkout()
    import torch

    if args.smoke:
        dev = torch.device("cpu")
    elif torch.cuda.is_available():
        dev = torch.device("cuda")
    else:
        print("no CUDA device: run with --smoke on a CPU", file=sys.stderr)
        return 2
    r = Report(args.smoke)
    skip = set(filter(None, args.skip.split(",")))
    ceiling = check_device(r, dev, args.smoke)
    peak = (r.data["device"].get("spec_bandwidth_gbps") or 0) * 1e9 or None
    sections = [
        ("kernels", lambda: check_kernels(r, dev, args.smoke)),
        ("attention", lambda: check_attention_bandwidth(r, dev, args.smoke, ceiling)),
        ("model", lambda: check_model(r, dev, args.smoke, ceiling, peak)),
        ("host", lambda: check_host(r, dev, args.smoke)),
    ]
    for name, run in sections:
        if name in skip:
            continue
        print(f"{name} ({r.elapsed():.0f} s)", flush=True)
        try:
            run()
        except Exception:  # a section that cannot finish is a failure, with its trace
            traceback.print_exc()
            r.data["failures"].append(f"{name}: {traceback.format_exc(limit=3)}")
        free_memory()
    goals(r)
    r.data["elapsed_s"] = r.elapsed()
    if args.json:
        Path(args.json).write_text(json.dumps(r.data, indent=1))
    status = "FAILED: " + ", ".join(f.split(":")[0] for f in r.data["failures"]) if r.data[
        "failures"] else "all checks passed"  # fmt: skip
    print(f"{status} in {r.elapsed():.0f} s")
    return 1 if r.data["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
