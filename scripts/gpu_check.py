#!/usr/bin/env python3
"""One device check of the GPU decode path: correctness first, then speed.

    python scripts/gpu_check.py --json out.json      # on a GPU, from the repository root
    python scripts/gpu_check.py --compile-only       # every kernel variant compiled, nothing run
    python scripts/gpu_check.py --smoke              # on the CPU, Triton interpreted, tiny shapes

Needs only torch and triton: the ``iterserve`` package is mapped onto this
checkout (pyproject maps ``iterserve.kernels`` to ``kernels/`` and so on),
so nothing has to be installed. Prints one line per figure; with ``--json``
the file is rewritten (temporary file, then rename) after every figure, so a
run cut short keeps everything it measured (``status`` says ``running`` until
the end). Sections, in order:

1. ``device``: what ran (torch, triton, GPU, L2), and ``copy_ceiling_gbps``,
   the device-to-device copy bandwidth (bytes read + written per second);
2. ``kernels``: every kernel against its torch reference (bf16 and fp16,
   head_dim 128, 32/8 heads, block 16): decode at batch 1 and 64 up to 8k
   context, split counts forced, the decode graphs' wide tables, a mixed
   batch, a cache of more than 2^31 elements;
3. ``model``: an 8B-shaped Llama with random weights built on the device.
   Prefill and decode logits of the Triton kernels, eager and graph-replayed,
   against an fp32 run of the same weights, with the torch references in bf16
   as the yardstick (the tolerance rule is in ``gpu_check_support``); the
   residual stream layer by layer; a replayed decode step against the same
   bucket run eagerly (same padding, same split plan: near bitwise). Then
   decode tok/s and MBU (bytes a step must read / step time) eager and
   graph-replayed at batch 1/8/32/64 with 1k tokens cached;
4. ``latency``: the shape of ``vllm bench latency``: batch 1 and 64, 1024
   prompt tokens, 128 greedy output tokens, prompts chunked at 16384 tokens a
   step; TTFT, TPOT and end-to-end latency (mean / median / p99);
5. ``attention``: paged attention bandwidth (K/V bytes / kernel time) as a
   fraction of the copy ceiling over a grid of (batch, context), each timed
   loop cycling over KV caches that together exceed L2 four times;
6. ``host``: host-side costs of building a batch and of sampling;
7. ``invariance``: a batch-invariant engine (a 144M-shaped Llama, bf16 and
   fp16) gives each row the same logits, to the bit, alone as among others,
   under chunked prefill and preemption (``gpu_check_invariance``); it puts
   the mode's products behind torch's for the rest of the process;
8. ``compile``: every kernel variant the runtime launches compiled for sm_90
   under this Triton (``tests/kernels/compile_variants.py``), with registers
   and spills: the device image's Triton is older than the suite's.

``--budget-s`` (default 330 s from the script's start, so that a run on an
H200 ends inside 6 minutes) is checked before each section and between the
units of work inside one; what does not fit is recorded under ``skipped``,
which is not a failure. Exit status 1 on any correctness failure (or a
section that raised). The speed goals are reported (``goals``), not enforced.
"""

from __future__ import annotations

import time

START = time.perf_counter()  # the budget counts from here

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from gpu_check_support import (  # noqa: E402
    ROOT,
    UNIT_S,
    Budget,
    Report,
    caches_to_rotate,
    free_memory,
    use_checkout,
)

__all__ = ["ROOT", "main", "use_checkout"]

SPEC_BANDWIDTH = [  # (name substring, bytes/s): the vendor's HBM figure
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12),
]
# The whole run on an H200 ends inside 6 minutes: 330 s of budget from the
# start, plus at most one unit of work in flight when it runs out (the longest,
# building and capturing the 8B model, ~30 s) and the exit.
DEFAULT_BUDGET_S = 330.0
# Seconds each section is expected to take on an H200 (Triton's cache cold);
# a section starts only when that much budget is left. Estimates, not figures.
NEEDS_S = {"kernels": 45, "model": 70, "latency": 40, "attention": 25, "host": 5,
           "invariance": 25, "compile": 40}  # fmt: skip
COMPILE_SCRIPT = ROOT / "tests" / "kernels" / "compile_variants.py"


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
                    capability=f"{props.major}.{props.minor}",
                    l2_mib=getattr(props, "L2_cache_size", 0) / 2**20)  # fmt: skip
        peak = next((bw for name, bw in SPEC_BANDWIDTH if name in props.name), None)
    for k, v in info.items():
        r.put("device", k, v)
    r.put("device", "spec_bandwidth_gbps", peak / 1e9 if peak else None)
    n = (64 << 20) if smoke or dev.type != "cuda" else (2 << 30)
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


def check_kernels(r: Report, dev, smoke: bool, budget: Budget) -> None:
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
            if not budget.allows(UNIT_S):
                r.skip("kernels", f"budget: stopped before attention_{case}_{name}")
                return
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
        if not smoke and not budget.allows(UNIT_S):
            r.skip("kernels", f"budget: stopped before the 2^31 cache ({name})")
            return
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


def check_attention_bandwidth(r: Report, dev, smoke: bool, ceiling: float,
                              budget: Budget) -> None:  # fmt: skip
    """Each cell's timed loop cycles over enough KV caches (each its own
    batch of sequences) that a cache is read again only after 4x L2's worth of
    others: a small batch's 4 MB cache would otherwise be replayed from L2."""
    import torch

    from iterserve.kernels import attention_plan, triton_attention

    dtype = torch.float32 if smoke else torch.bfloat16
    geometry = dict(heads=4, kv_heads=2, head_dim=32) if smoke else {}
    grid = [(1, 128), (4, 256)] if smoke else [
        (b, c) for b in (1, 8, 32, 64, 128) for c in (1024, 4096, 8192)
    ]  # fmt: skip
    l2 = 0
    if dev.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 50 << 20
    iters = 3 if smoke else 20
    for i, (batch, context) in enumerate(grid):
        if not budget.allows(UNIT_S):
            r.skip("attention", f"budget: {i} of {len(grid)} grid cells measured")
            return
        first = attention_case(torch, dev, dtype, [(context - 1, 1)] * batch, **geometry)
        _, _, kv_heads, head_dim = first[1].shape
        kv_bytes = 2 * batch * context * kv_heads * head_dim * first[1].element_size()
        count = caches_to_rotate(kv_bytes, l2) if l2 else 2  # the CPU: two, to run the path
        cases = [first] + [attention_case(torch, dev, dtype, [(context - 1, 1)] * batch,
                                          seed=s, **geometry) for s in range(1, count)]  # fmt: skip
        calls = count * math.ceil(iters / count)  # every cache read equally often
        ring = itertools.cycle(cases)
        seconds = gpu_seconds(lambda ring=ring: triton_attention.paged_attention(*next(ring),
                                                                                 max_query_len=1),
                              calls, dev, warmup=count)  # fmt: skip
        gbps = kv_bytes / seconds / 1e9
        row = {"batch": batch, "context": context, "us": seconds * 1e6, "gbps": gbps,
               "fraction_of_ceiling": gbps / ceiling, "kv_caches": count,
               "rotation_mib": count * kv_bytes / 2**20}  # fmt: skip
        if batch == 1:  # what the split buys: the same call with one split
            tiles = attention_plan.tiles_for(first[0].element_size(), first[0].shape[2],
                                             first[0].shape[1] // first[1].shape[2])  # fmt: skip
            plan = attention_plan.AttentionPlan(tiles, 1, True, False)
            ring = itertools.cycle(cases)
            one = gpu_seconds(lambda p=plan, ring=ring: triton_attention.run_plan(p, *next(ring)),
                              calls, dev, warmup=count)  # fmt: skip
            row["no_split_fraction_of_ceiling"] = kv_bytes / one / 1e9 / ceiling
        r.add_row("attention", "grid", row)
        print(f"  attention b={batch:<4d} ctx={context:<5d} {seconds * 1e6:8.1f} us "
              f"{gbps:7.0f} GB/s  {gbps / ceiling:5.1%} of ceiling ({count} caches)",
              flush=True)  # fmt: skip
        del first, cases, ring
        free_memory()


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


# ---------------------------------------------------------------------- compile


def check_compile(r: Report, budget: Budget, script: Path = COMPILE_SCRIPT) -> None:
    """Every Triton kernel variant the runtime launches, compiled for sm_90 with
    this process's Triton (the suite's ``compile_variants.py``, in a
    subprocess with the interpreter off): the device image's Triton is not the
    one the suite runs, and a kernel using a newer API fails here first. Spills
    are reported; the suite enforces none under its own Triton."""
    import triton

    r.put("compile", "triton", triton.__version__)
    if not script.exists():
        r.skip("compile", f"{script.relative_to(ROOT)} is not in this checkout")
        return
    boot = (
        f"import runpy, sys; sys.path.insert(0, {str(SCRIPTS)!r}); import gpu_check_support as s; "
        f"s.use_checkout(); sys.argv = [{str(script)!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", boot], env=env, cwd=ROOT, text=True,
                              capture_output=True, timeout=max(30.0, budget.left()))  # fmt: skip
    except subprocess.TimeoutExpired:
        r.skip("compile", "budget: the compile run outlasted what was left")
        return
    records = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    summary = records.pop() if records and "variants" in records[-1] else None
    ok = proc.returncode in (0, 1) and summary is not None and summary["variants"] == len(records)
    detail: dict = {"variants": len(records), "seconds": time.perf_counter() - start,
                    "kernels": sorted({v["kernel"] for v in records})}  # fmt: skip
    if not ok:
        detail["returncode"] = proc.returncode
        detail["stderr_tail"] = proc.stderr[-2000:]
    r.check("compile", "every_variant_compiles", ok, detail)
    most: dict[str, int] = {}
    for v in records:
        most[v["kernel"]] = max(most.get(v["kernel"], 0), v["registers"])
    r.put("compile", "max_registers", most)
    r.put("compile", "spilling_variants", [
        {"kernel": v["kernel"], "constexprs": v["constexprs"], "num_warps": v["num_warps"],
         "registers": v["registers"], "spill_stores": v["spill_stores"]}
        for v in records if v["spills"]
    ])  # fmt: skip


# ------------------------------------------------------------------------ goals


def goals(r: Report) -> None:
    out = {}
    decode = {row["batch"]: row for row in r.data.get("model", {}).get("decode", [])}
    if 1 in decode and "graphs_mbu" in decode[1]:
        out["decode_mbu_b1_ctx1k_graphs>=0.70"] = decode[1]["graphs_mbu"]
    host_bound = [row["graphs_over_eager"] for b, row in decode.items()
                  if b <= 8 and "graphs_over_eager" in row]  # fmt: skip
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


def main(argv: list[str] | None = None, *, started: float | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures to this file (after every figure)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, Triton interpreted, tiny shapes (what CI runs)")  # fmt: skip
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds from the start after which no section or unit of "
                             "work starts (default %(default)s)")  # fmt: skip
    parser.add_argument("--compile-only", action="store_true",
                        help="only the device and compile sections")  # fmt: skip
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    use_checkout()
    import torch
    from gpu_check_invariance import check_invariance
    from gpu_check_model import ModelBench, check_latency, check_model

    if args.smoke:
        dev = torch.device("cpu")
    elif torch.cuda.is_available():
        dev = torch.device("cuda")
    elif not args.compile_only:
        print("no CUDA device: run with --smoke on a CPU", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cpu")
    started = START if started is None else started
    r = Report(args.smoke, args.json, started=started)
    budget = Budget(args.budget_s, started)
    r.data["budget_s"] = args.budget_s
    skip = set(filter(None, args.skip.split(",")))
    r.begin("device")
    ceiling = check_device(r, dev, args.smoke)
    peak = (r.data["device"].get("spec_bandwidth_gbps") or 0) * 1e9 or None
    bench = ModelBench(dev, args.smoke, r)
    sections = [
        ("kernels", lambda: check_kernels(r, dev, args.smoke, budget)),
        ("model", lambda: check_model(r, bench, ceiling, peak, budget)),
        ("latency", lambda: check_latency(r, bench, budget)),
        ("attention", lambda: check_attention_bandwidth(r, dev, args.smoke, ceiling, budget)),
        ("host", lambda: check_host(r, dev, args.smoke)),
        ("invariance", lambda: check_invariance(r, dev, args.smoke, budget)),
        ("compile", lambda: check_compile(r, budget)),
    ]
    if args.compile_only:
        sections = [s for s in sections if s[0] == "compile"]
    elif args.smoke and "compile" not in skip:
        skip.add("compile")  # the suite's test_kernel_compile.py compiles the same variants
    for name, run in sections:
        if name in skip:
            r.skip(name, "--skip" if not (args.smoke and name == "compile") else
                   "smoke: tests/kernels/test_kernel_compile.py compiles every variant")  # fmt: skip
            continue
        needs = 0.0 if args.smoke else NEEDS_S[name]
        if not budget.allows(needs):
            wants = f", needs ~{needs:.0f} s" if needs else ""
            r.skip(name, f"budget: {max(0.0, budget.left()):.0f} s left{wants}")
            continue
        r.begin(name)
        try:
            run()
        except Exception:  # a section that cannot finish is a failure, with its trace
            traceback.print_exc()
            r.fail(f"{name}: {traceback.format_exc(limit=3)}")
        if name == "latency":
            bench.close()  # the last section that needs the model
        free_memory()
    bench.close()
    goals(r)
    r.finish()
    status = "FAILED: " + ", ".join(f.split(":")[0] for f in r.data["failures"]) if r.data[
        "failures"] else "all checks passed"  # fmt: skip
    left_out = f" ({len(r.data['skipped'])} skipped)" if r.data["skipped"] else ""
    print(f"{status}{left_out} in {r.elapsed():.0f} s")
    return 1 if r.data["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
