"""The 8B-shaped model of ``scripts/gpu_check.py``: its logits against an fp32
run of the same weights, a graph replay against the same bucket run eagerly,
decode tok/s and MBU, and latency figures in the shape of ``vllm bench latency``.

One runner serves the ``model`` and ``latency`` sections (:class:`ModelBench`),
built on first use. Its KV blocks: the logits check's prompts from block 0, the
decoding sequences after them; the latency runs reuse blocks from 0 once both
are released.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

from gpu_check_support import (
    LLAMA_8B,
    SAME_PLAN_LIMIT,
    SMOKE_LLAMA,
    TRUTH_FLOOR,
    TRUTH_RATIO,
    UNIT_S,
    Budget,
    Report,
    StreamRecorder,
    against_truth,
    decode_read_bytes,
    free_memory,
    llama_config,
    prefill_pieces,
    rel_err,
    summary,
)

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Sizes:
    dtype: str  # of the weights, activations and KV cache
    batches: tuple[int, ...]  # decode tok/s batch sizes (and graph buckets)
    context: int  # tokens cached before the timed decode steps
    steps: int  # timed decode steps per batch size and mode
    warmup: int
    lens: tuple[int, ...]  # the logits check's prompts, one step
    lat_batches: tuple[int, ...]
    lat_input: int
    lat_output: int
    lat_step_tokens: int  # prefill tokens per step
    lat_iters: int
    lat_warmup: int


# vllm bench latency's shape: --batch-size 1 / 64 --input-len 1024 --output-len 128.
# 16384 tokens a step is vLLM's default max_num_batched_tokens for its offline
# engine (what bench latency runs) on GPUs of 70 GiB or more.
FULL = Sizes("bfloat16", (1, 8, 32, 64), 1024, 24, 3, (700, 129),
             (1, 64), 1024, 128, 16384, 5, 1)  # fmt: skip
# fp16, not bf16: the interpreter gets bf16 dots wrong; fp16 still has a
# reference error against fp32 for the tolerance rule to work with.
SMOKE = Sizes("float16", (1, 4), 64, 2, 1, (40, 17), (1, 4), 12, 3, 20, 1, 0)


def model_config(smoke: bool):
    """Llama-3-8B's shape, or a tiny one in smoke mode."""
    return llama_config(SMOKE_LLAMA if smoke else LLAMA_8B)


class ModelBench:
    """The runner of the 8B-shaped model (a tiny one in smoke mode), built on first use."""

    def __init__(self, dev, smoke: bool, r: Report):
        import torch

        from iterserve.scheduler.blocks import blocks_for

        self.dev, self.smoke, self.r = dev, smoke, r
        self.sizes = s = SMOKE if smoke else FULL
        self.config = model_config(smoke)
        self.dtype = getattr(torch, s.dtype)
        self.prompt_blocks = sum(blocks_for(n + 2, BLOCK_SIZE) for n in s.lens)
        # Each decoding sequence grows by every step it runs: warm-up and timed,
        # eager and replayed, at each batch size.
        growth = len(s.batches) * 2 * (s.warmup + s.steps)
        self.decode_blocks = max(s.batches) * blocks_for(s.context + 1 + growth, BLOCK_SIZE)
        latency_blocks = max(s.lat_batches) * blocks_for(s.lat_input + s.lat_output, BLOCK_SIZE)
        self.num_blocks = max(self.prompt_blocks + self.decode_blocks, latency_blocks)
        self.runner = None

    def get(self):
        if self.runner is None:
            from iterserve.workers.model import weight_bytes
            from iterserve.workers.runner import ModelRunner

            s = self.sizes
            start = time.perf_counter()
            self.runner = ModelRunner.from_config(
                self.config, dtype=self.dtype, device=self.dev, num_kv_blocks=self.num_blocks,
                block_size=BLOCK_SIZE, kernel_backend="triton", cuda_graphs=True,
                graph_batch_sizes=sorted(set(s.batches) | set(s.lat_batches)),
            )  # fmt: skip
            self.r.put("model", "build_and_capture_s", time.perf_counter() - start)
            self.r.put("model", "weight_gib", weight_bytes(self.config, self.dtype) / 2**30)
        return self.runner

    def close(self) -> None:
        self.runner = None
        free_memory()


@contextlib.contextmanager
def fp32_products():
    """fp32 matrix products in fp32 (no TF32) for the truth."""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.set_float32_matmul_precision(saved[1])


@contextlib.contextmanager
def plans_chosen():
    """The KV split counts of the Triton attention calls made inside (empty for
    a CUDA graph replay, which makes no Python calls: its plan was chosen at
    capture)."""
    from iterserve.kernels import triton_attention

    seen: list[int] = []
    real = triton_attention.plan_attention

    def plan(**kw):
        chosen = real(**kw)
        seen.append(chosen.num_splits)
        return chosen

    triton_attention.plan_attention = plan
    try:
        yield seen
    finally:
        triton_attention.plan_attention = real


def check_model(r: Report, bench: ModelBench, ceiling: float, peak: float | None,
                budget: Budget) -> None:  # fmt: skip
    bench.get()
    check_logits(r, bench)
    free_memory()
    if not budget.allows(UNIT_S):
        r.skip("model.decode", "budget: no time left for decode tok/s")
        return
    check_decode_speed(r, bench, ceiling, peak, budget)


# ---------------------------------------------------------------- correctness


def check_logits(r: Report, bench: ModelBench) -> None:
    """Triton logits against the truth (see gpu_check_support's tolerance
    rule): two prompts in one step, then a decode step of both, eager and
    replayed; the replay against the same bucket run eagerly."""
    import torch

    from iterserve.kernels import get_ops
    from iterserve.scheduler.blocks import blocks_for
    from iterserve.scheduler.messages import NewSequence, ScheduledSeq, StepPlan
    from iterserve.scheduler.sampling import SamplingParams
    from iterserve.workers.batch import layout_batch, to_device
    from iterserve.workers.graphs import bucket_for
    from iterserve.workers.kv_cache import KVCache
    from iterserve.workers.model import Decoder

    runner, config, dev = bench.runner, bench.config, bench.dev
    assert runner is not None
    triton_ops, torch_ops = runner.ops, get_ops("torch")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
               for n in bench.sizes.lens]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    slot0 = 1000
    slots = [slot0 + i for i in range(len(prompts))]
    new = [
        NewSequence(s, f"p{i}", s, p, len(p), params)
        for i, (s, p) in enumerate(zip(slots, prompts))
    ]
    tables, nb = [], 0
    for p in prompts:
        n = blocks_for(len(p) + 2, BLOCK_SIZE)
        tables.append(list(range(nb, nb + n)))
        nb += n
    entries = [
        ScheduledSeq(s, 0, len(p), t, sample=True) for s, p, t in zip(slots, prompts, tables)
    ]
    plan = runner.table.apply(StepPlan(10_000, new_seqs=new, scheduled=entries))

    # The truth: the same weights widened to fp32 through the torch references.
    model = Decoder(config, torch_ops, runner.model.cos_sin, dtype=torch.float32, device=dev)
    model.load_state_dict(runner.model.state_dict())
    kv = KVCache.allocate(config.num_layers, nb, BLOCK_SIZE, config.num_kv_heads,
                          config.head_dim, torch.float32, dev)  # fmt: skip
    model.bind_kv_cache(kv)
    truth = {"model": model, "kv": kv}  # ~32 GB at 8B: dropped once the decode step has run
    del model, kv

    def layout(plan, scratch):
        return layout_batch(plan, runner.table, block_size=BLOCK_SIZE, scratch_block=scratch,
                            pad_token_id=0, max_position=config.max_position_embeddings)  # fmt: skip

    def run_truth(plan):
        model, kv = truth["model"], truth["kv"]
        b = to_device(layout(plan, kv.scratch_block), dev)
        rec = StreamRecorder(torch_ops)
        model.set_ops(rec.ops, kv)
        with fp32_products():
            logits = model(b.input_ids, b.attn, b.logits_indices)
        return logits.float(), rec.layers()

    def run(host, ops):
        rec = StreamRecorder(ops)
        runner.model.set_ops(rec.ops, runner.kv_cache)
        try:
            return runner.forward(host, replay=False).float(), rec.layers()
        finally:
            runner.model.set_ops(triton_ops, runner.kv_cache)

    def check(key, got, want, true):
        res = against_truth(got, want, true)
        r.check("model", key, res.pop("ok"), res)

    # Prefill: the torch pass writes the cache, the Triton pass writes it again.
    host = layout(plan, runner.kv_cache.scratch_block)
    true, true_layers = run_truth(plan)
    want, want_layers = run(host, torch_ops)
    got, got_layers = run(host, triton_ops)
    check("prefill_logits_triton_vs_fp32", got, want, true)
    check_layers(r, "prefill_layers_triton_vs_fp32", got_layers, want_layers, true_layers)
    del want_layers, got_layers, true_layers

    # Decode: both bf16 paths read the prompts' KV as the Triton pass wrote it.
    for e in plan.scheduled:
        runner.table.advance(e)
    for s, tok in zip(slots, true.argmax(-1).tolist()):
        runner.table.append_token(s, tok)
    decode = runner.table.apply(StepPlan(10_001, scheduled=[
        ScheduledSeq(s, len(p), 1, [], sample=True) for s, p in zip(slots, prompts)
    ]))  # fmt: skip
    host = layout(decode, runner.kv_cache.scratch_block)
    true, _ = run_truth(decode)
    want, _ = run(host, torch_ops)
    with plans_chosen() as unpadded:
        got, _ = run(host, triton_ops)
    check("decode_logits_triton_vs_fp32", got, want, true)
    truth.clear()
    free_memory()

    graphs = runner.graphs
    replayable = graphs is not None and graphs.replayable(host)
    r.put("model", "decode_step_replayed", replayable)
    if graphs is not None and replayable:
        with plans_chosen() as replay_plan:
            replayed = graphs.run(host).float()
        with plans_chosen() as bucket_plan:
            same = graphs.run(host, eager=True).float()
        check("decode_logits_graph_vs_fp32", replayed, want, true)
        diff = rel_err(replayed, same)
        r.check("model", "decode_logits_graph_vs_eager_same_plan", diff <= SAME_PLAN_LIMIT, {
            "rel_err": diff, "limit": SAME_PLAN_LIMIT, "bitwise_equal": torch.equal(replayed, same),
            "max_abs_diff": float((replayed - same).abs().max()),
            "rows": host.num_rows, "bucket": bucket_for(host.num_rows, graphs.batch_sizes),
            "splits": {"graph_replay": sorted(set(replay_plan)) or "chosen at capture",
                       "same_bucket_eager": sorted(set(bucket_plan)),
                       "unpadded_eager": sorted(set(unpadded))},
        })  # fmt: skip
    else:
        r.check("model", "decode_logits_graph_vs_eager_same_plan", False,
                {"why": "the decode step does not fit a captured graph"})  # fmt: skip
    runner.execute(StepPlan(10_002, released_slots=slots))


def check_layers(r: Report, key: str, got: list, want: list, true: list) -> None:
    """The residual stream after each layer, Triton and torch against fp32, by
    the same rule as the logits: a bug shows at the layer where it is, before
    depth has grown the bf16 error around it (emulated, the ratio stays within
    0.91-1.12 at every layer)."""
    errs = [rel_err(g, t) for g, t in zip(got, true)]
    refs = [rel_err(w, t) for w, t in zip(want, true)]
    margins = [(TRUTH_RATIO * f + TRUTH_FLOOR) / e if e > 0 else float("inf")
               for e, f in zip(errs, refs)]  # fmt: skip
    worst = min(range(len(margins)), key=margins.__getitem__)
    r.check("model", key, margins[worst] >= 1.0, {
        "worst_layer": worst, "worst_margin": margins[worst],
        "triton_rel_err": [round(e, 5) for e in errs],
        "torch_rel_err": [round(e, 5) for e in refs],
    })  # fmt: skip


# -------------------------------------------------------------------- decode


class Sequences:
    """Plans for a runner: sequences whose KV is taken as already cached (the
    contents do not change the time), each decoding one token per step, their
    blocks from ``first_block`` up."""

    def __init__(self, runner, count: int, context: int, first_block: int = 0):
        from iterserve.scheduler.blocks import blocks_for
        from iterserve.scheduler.messages import NewSequence, StepPlan
        from iterserve.scheduler.sampling import SamplingParams

        self.runner, self.step, self.count = runner, 0, count
        bs = runner.block_size
        params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
        new = [NewSequence(i, f"s{i}", i, [1] * (context + 1), context + 1, params)
               for i in range(count)]  # fmt: skip
        runner.execute(StepPlan(self.next_step(), new_seqs=new))
        self.next_block = first_block
        for i in range(count):
            seq = runner.table.get(i)
            need = blocks_for(context + 1, bs)
            seq.block_ids = list(range(self.next_block, self.next_block + need))
            self.next_block += need
            seq.num_computed_tokens = context

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def kv_lens(self, count: int) -> list[int]:
        """Each row's KV length in its next decode step (the new position included)."""
        return [self.runner.table.get(i).num_computed_tokens + 1 for i in range(count)]

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

    def release(self) -> None:
        from iterserve.scheduler.messages import StepPlan

        self.runner.execute(StepPlan(self.next_step(), released_slots=list(range(self.count))))


def check_decode_speed(r: Report, bench: ModelBench, ceiling: float, peak: float | None,
                       budget: Budget) -> None:  # fmt: skip
    """Decode tok/s and MBU, eager and graph-replayed, at ``context`` tokens
    cached. MBU: the bytes a step must read (``decode_read_bytes``: the
    weights, the embedding rows used, each row's own KV) over its wall time."""
    import torch

    from iterserve.workers.model import weight_bytes

    runner, config, s = bench.get(), bench.config, bench.sizes
    weights = weight_bytes(config, bench.dtype)
    elem = torch.empty((), dtype=bench.dtype).element_size()
    seqs = Sequences(runner, max(s.batches), s.context, first_block=bench.prompt_blocks)
    saved = runner.graphs
    try:
        for batch in s.batches:
            if not budget.allows(UNIT_S):
                r.skip("model.decode", f"budget: stopped before batch {batch}")
                break
            row: dict = {"batch": batch, "context": s.context}
            for mode in ("eager", "graphs"):
                runner.graphs = None if mode == "eager" else saved
                for _ in range(s.warmup):
                    seqs.decode(batch)
                if bench.dev.type == "cuda":
                    torch.cuda.synchronize()
                walls, forwards, reads = [], [], []
                for _ in range(s.steps):
                    reads.append(decode_read_bytes(config, elem, weights, seqs.kv_lens(batch)))
                    t = time.perf_counter()
                    result = seqs.decode(batch)
                    walls.append(time.perf_counter() - t)
                    forwards.append(result.forward_s)
                wall = statistics.median(walls)
                rate = statistics.median(b["total"] / w for b, w in zip(reads, walls))
                row[f"{mode}_tok_s"] = batch / wall
                row[f"{mode}_step_ms"] = wall * 1e3
                row[f"{mode}_forward_ms"] = statistics.median(forwards) * 1e3
                row[f"{mode}_read_gb"] = statistics.mean(b["total"] for b in reads) / 1e9
                row[f"{mode}_kv_read_gb"] = statistics.mean(b["kv"] for b in reads) / 1e9
                row[f"{mode}_mbu_vs_copy_ceiling"] = rate / (ceiling * 1e9)
                if peak:
                    row[f"{mode}_mbu"] = rate / peak
            row["graphs_over_eager"] = row["graphs_tok_s"] / row["eager_tok_s"]
            r.add_row("model", "decode", row)
            print(f"  model decode b={batch:<3d} eager {row['eager_tok_s']:9.1f} tok/s "
                  f"graphs {row['graphs_tok_s']:9.1f} tok/s  x{row['graphs_over_eager']:.2f}  "
                  f"MBU {row.get('graphs_mbu', row['graphs_mbu_vs_copy_ceiling']):.1%}",
                  flush=True)  # fmt: skip
    finally:
        runner.graphs = saved
        seqs.release()
    r.put("model", "graph_replays", saved.num_replays if saved is not None else 0)


# ------------------------------------------------------------------- latency


def latency_run(runner, *, batch: int, input_len: int, output_len: int, step_tokens: int,
                vocab: int, gen, step: int) -> tuple[dict, int]:  # fmt: skip
    """One ``vllm bench latency`` iteration: ``batch`` random prompts arrive
    together; each step takes every row that has a first token for one decode
    token and fills the rest of ``step_tokens`` with prompt pieces in order (a
    prompt may be cut across steps), as vLLM's chunked prefill does; greedy;
    every row runs to ``output_len`` tokens. Returns each row's time to first
    token and to last, in seconds from the start, and the last step number."""
    import torch

    from iterserve.scheduler.blocks import blocks_for
    from iterserve.scheduler.messages import NewSequence, ScheduledSeq, StepPlan
    from iterserve.scheduler.sampling import SamplingParams

    need = blocks_for(input_len + output_len, runner.block_size)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    slots = [2000 + i for i in range(batch)]
    prompts = torch.randint(0, vocab, (batch, input_len), generator=gen).tolist()
    pending = [NewSequence(s, f"lat{s}", s, p, input_len, params) for s, p in zip(slots, prompts)]
    left = dict.fromkeys(range(batch), input_len)
    produced = [0] * batch
    first: list[float] = [0.0] * batch
    done: list[float | None] = [None] * batch
    start = time.perf_counter()
    while any(d is None for d in done):
        decodes = [i for i in range(batch) if produced[i] and done[i] is None]
        pieces = prefill_pieces(left, len(decodes), step_tokens)
        scheduled = [ScheduledSeq(slots[i], input_len + produced[i] - 1, 1, [], sample=True)
                     for i in decodes]  # fmt: skip
        for i, n in pieces:
            pos = input_len - left[i]
            blocks = list(range(i * need, (i + 1) * need)) if pos == 0 else []
            scheduled.append(ScheduledSeq(slots[i], pos, n, blocks, sample=n == left[i]))
        step += 1
        runner.execute(StepPlan(step, new_seqs=pending, scheduled=scheduled))
        pending = []
        now = time.perf_counter() - start
        for i in decodes:
            produced[i] += 1
        for i, n in pieces:
            left[i] -= n
            if left[i] == 0:
                produced[i], first[i] = 1, now
        for i in range(batch):
            if done[i] is None and produced[i] >= output_len:
                done[i] = now
    step += 1
    runner.execute(StepPlan(step, released_slots=slots))
    return {"first": first, "last": done}, step


def check_latency(r: Report, bench: ModelBench, budget: Budget) -> None:
    """TTFT per row (from the batch's arrival to its first token), TPOT per row
    ((last - first) / (output - 1)), and end-to-end latency per iteration (the
    batch's last token: what ``vllm bench latency`` reports as its latency)."""
    import torch

    runner, s = bench.get(), bench.sizes
    gen = torch.Generator().manual_seed(7)
    r.put("latency", "shape", {"input_len": s.lat_input, "output_len": s.lat_output,
                               "prefill_tokens_per_step": s.lat_step_tokens, "sampling": "greedy",
                               "dtype": s.dtype, "iterations": s.lat_iters,
                               "warmup_iterations": s.lat_warmup})  # fmt: skip
    step = 20_000
    for batch in s.lat_batches:
        e2e: list[float] = []
        ttft: list[float] = []
        tpot: list[float] = []
        last = None
        for it in range(s.lat_warmup + s.lat_iters):
            if not budget.allows(UNIT_S if last is None else 1.2 * last + 1):
                break
            t = time.perf_counter()
            out, step = latency_run(runner, batch=batch, input_len=s.lat_input,
                                    output_len=s.lat_output, step_tokens=s.lat_step_tokens,
                                    vocab=bench.config.vocab_size, gen=gen, step=step)  # fmt: skip
            last = time.perf_counter() - t
            if it < s.lat_warmup:
                continue
            e2e.append(max(out["last"]))
            ttft += out["first"]
            if s.lat_output > 1:
                tpot += [(b - a) / (s.lat_output - 1) for a, b in zip(out["first"], out["last"])]
        if not e2e:
            r.skip(f"latency.b{batch}", "budget: no iteration fitted")
            continue
        row = {"batch": batch, "iterations": len(e2e), "e2e_s": summary(e2e),
               "ttft_ms": summary(ttft, 1e3), "tpot_ms": summary(tpot, 1e3) if tpot else None,
               "output_tok_s": batch * s.lat_output / statistics.mean(e2e)}  # fmt: skip
        if len(e2e) < s.lat_iters:
            row["truncated"] = f"budget: {len(e2e)} of {s.lat_iters} iterations"
        r.add_row("latency", "runs", row)
        tp = row["tpot_ms"]["median"] if tpot else float("nan")
        print(f"  latency b={batch:<3d} e2e {row['e2e_s']['mean']:.3f} s  "
              f"TTFT {row['ttft_ms']['median']:.1f} ms  TPOT {tp:.2f} ms  "
              f"({len(e2e)} iterations)", flush=True)  # fmt: skip
