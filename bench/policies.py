"""The batching lab: one workload, one model, one seed, every policy, one invocation.

Each policy serves the same requests through the real engine on Ray (scheduler
actor, model worker, CPU, TP=1), arriving open-loop on the same schedule; then
Hugging Face ``generate`` serves them as the peer baseline. Every request has
``ignore_eos`` and ``max_tokens`` set to its drawn output length, so every run
computes exactly the same output tokens, which is asserted. Nothing here
asserts on time: the figures are printed side by side and written as JSON.

Workloads (see docs/benchmarks.md for why they look like this):

- ``longtail``: Poisson arrivals faster than any policy serves them, short
  prompts, lognormal output lengths capped at a quarter of the context (many
  short, a few long): the first-finisher problem.
- ``long-prompts``: steady streams decoding long outputs while prompts of 60-90% of
  the context arrive periodically: the prefill stall.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from iterserve.bench.report import (
    RequestTiming,
    median_entry,
    policy_entry,
    prometheus_values,
    render_policies,
    step_figures,
    targets,
    write_json,
)
from iterserve.cluster.config import EngineConfig
from iterserve.cluster.gc_pauses import freeze_startup_objects
from iterserve.scheduler import POLICIES, SamplingParams

WALL_CAP_S = 1800.0  # one policy's run never outlives this, whatever the machine


@dataclass(frozen=True)
class Spec:
    name: str
    num_requests: int  # longtail: all; long-prompts: streams + long prompts
    max_model_len: int
    max_num_seqs: int = 16
    chunk_budget: int = 128  # chunked's per-step token budget
    batch_timeout_s: float = 2.0  # static; at the longtail rate a full batch arrives in ~0.5 s
    batch_wait_s: float = 0.25  # dynamic
    request_rate: float = 32.0  # longtail arrivals per second (Poisson)
    output_median: int = 32  # longtail output lengths: lognormal(ln median, sigma), capped
    output_sigma: float = 1.3
    num_streams: int = 8  # long-prompts: streams decoding from t=0
    long_interval_s: float = 0.75  # long-prompts: one long prompt every this many seconds
    repeats: int = 1  # rounds of every policy; figures are medians (p99 ITL is noise-prone)


SPECS = {
    "longtail": {
        "full": Spec("longtail", num_requests=320, max_model_len=1024),
        "small": Spec("longtail", num_requests=24, max_model_len=128, max_num_seqs=4,
                      chunk_budget=16, batch_timeout_s=0.2, batch_wait_s=0.05, output_median=6),
    },
    "long-prompts": {
        "full": Spec("long-prompts", num_requests=8 + 16, max_model_len=1024, chunk_budget=64,
                     repeats=3),
        "small": Spec("long-prompts", num_requests=4 + 4, max_model_len=128, max_num_seqs=4,
                      chunk_budget=16, batch_timeout_s=0.2, batch_wait_s=0.05, num_streams=4,
                      long_interval_s=0.1),
    },
}  # fmt: skip


@dataclass
class BenchRequest:
    request_id: str
    arrival_s: float
    prompt_ids: list[int]
    output_len: int
    kind: str  # chat | stream | long


def build(spec: Spec, vocab_size: int, seed: int) -> list[BenchRequest]:
    """The workload's requests in arrival order; the same for every policy."""
    rng = np.random.default_rng(seed)
    ctx = spec.max_model_len

    def prompt(n: int) -> list[int]:
        return rng.integers(3, vocab_size, int(n)).tolist()  # ids 0-2 are often special

    out: list[tuple[float, int, int, str]] = []  # (arrival, prompt_len, output_len, kind)
    if spec.name == "longtail":
        arrivals = np.cumsum(rng.exponential(1.0 / spec.request_rate, spec.num_requests))
        prompt_lens = rng.integers(ctx // 64, ctx // 16 + 1, spec.num_requests)
        drawn = rng.lognormal(math.log(spec.output_median), spec.output_sigma, spec.num_requests)
        output_lens = np.clip(np.rint(drawn), 2, ctx // 4)
        out = [
            (a - arrivals[0], p, o, "chat") for a, p, o in zip(arrivals, prompt_lens, output_lens)
        ]
    else:
        # Streams start together and decode for most of the run; long prompts keep coming.
        for i in range(spec.num_streams):
            out.append((0.02 * i, ctx // 32, int(ctx * rng.uniform(0.5, 0.6)), "stream"))
        for k in range(spec.num_requests - spec.num_streams):
            length = int(ctx * rng.uniform(0.6, 0.9))
            out.append((spec.long_interval_s * (k + 0.5), length, max(2, ctx // 64), "long"))
    return [
        BenchRequest(f"{kind}-{i}", round(float(a), 4), prompt(p), int(o), kind)
        for i, (a, p, o, kind) in enumerate(out)
    ]


def describe(spec: Spec, requests: list[BenchRequest], seed: int) -> dict:
    outputs = [r.output_len for r in requests]
    prompts = [len(r.prompt_ids) for r in requests]
    return {
        **asdict(spec),
        "seed": seed,
        "num_output_tokens": sum(outputs),
        "output_len": {"min": min(outputs), "p50": int(np.median(outputs)), "max": max(outputs)},
        "prompt_len": {"min": min(prompts), "p50": int(np.median(prompts)), "max": max(prompts)},
        "arrival_span_s": max(r.arrival_s for r in requests),
    }


def engine_config(policy: str, spec: Spec, model: str, torch_threads: int) -> EngineConfig:
    """The same slots, KV cache and threads for every policy; only the batching differs.
    Whole-prompt policies get twice max_model_len as their budget, so a step can always
    take the longest prompt; chunked gets a small budget so every step stays short."""
    return EngineConfig(
        model=model,
        dtype="float32",
        device="cpu",
        kernel_backend="torch",
        policy=policy,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.chunk_budget if policy == "chunked" else 2 * spec.max_model_len,
        max_model_len=spec.max_model_len,
        # Every slot can hold a full-length sequence: no policy ever preempts.
        num_kv_blocks=spec.max_num_seqs * (spec.max_model_len // 16 + 2),
        block_size=16,
        batch_timeout_s=spec.batch_timeout_s,
        batch_wait_s=spec.batch_wait_s,
        torch_threads=torch_threads,
        num_cpus_per_worker=1.0,
    )


async def run_policy(config: EngineConfig, requests: list[BenchRequest]) -> dict:
    """Serves ``requests`` open-loop through a fresh engine; one policy's entry."""
    from iterserve.cluster.engine import AsyncEngine

    engine = await AsyncEngine(config).start()
    try:
        # One short request first, so one-off costs (first kernels, allocator) stay out.
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        async for _ in engine.generate(requests[0].prompt_ids[:8], warm, request_id="warmup"):
            pass
        before = prometheus_values(await engine.actor.metrics_text.remote())
        start = time.perf_counter()

        async def one(req: BenchRequest) -> RequestTiming:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            timing = RequestTiming(sent_s=time.perf_counter() - start)
            params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
            async for out in engine.generate(req.prompt_ids, params, request_id=req.request_id):
                timing.add(time.perf_counter() - start, len(out.token_ids))
            return timing

        timings = await asyncio.wait_for(asyncio.gather(*map(one, requests)), WALL_CAP_S)
        after = prometheus_values(await engine.actor.metrics_text.remote())
    finally:
        await engine.shutdown()
    makespan = max(t.chunks[-1][0] for t in timings if t.chunks)
    steps = step_figures(before, after, config.max_num_seqs)
    return policy_entry([r.kind for r in requests], timings, makespan, steps)


def run_hf(model: str, requests: list[BenchRequest], batch_size: int, threads: int) -> dict:
    """Hugging Face ``generate`` as static batching: batches of ``batch_size`` in arrival
    order, left-padded, greedy, every member run to the batch's longest output
    (``min_new_tokens`` keeps EOS from ending it early); a member's useful output is
    its first ``output_len`` tokens.

    A batch starts when the previous one has returned and its last member has
    arrived; the clock between batches is virtual (no sleeping). Tokens are timed
    per generated position, as if streamed: TTFT is the first position's time and
    E2E the time of a member's last useful token, generous to the baseline, since
    ``generate`` itself returns the whole batch at the end.
    """
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        """Records when each generated position is ready; never stops generation."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    timings, free_at, useful, slots_x_positions, padding, computed = [], 0.0, 0, 0, 0, 0
    generate_s = 0.0
    try:
        for b in range(0, len(requests), batch_size):
            batch = requests[b : b + batch_size]
            width = max(len(r.prompt_ids) for r in batch)
            new = max(r.output_len for r in batch)
            ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
            mask = (
                torch.arange(width) >= width - torch.tensor([[len(r.prompt_ids)] for r in batch])
            ).long()
            clock = Clock()
            start = time.perf_counter()
            with torch.no_grad():
                hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=pad,
                            stopping_criteria=StoppingCriteriaList([clock]))  # fmt: skip
            began = max(free_at, batch[-1].arrival_s)
            positions = [began + t - start for t in clock.times]  # [new]
            free_at = positions[-1]
            generate_s += clock.times[-1] - start
            for r in batch:
                timing = RequestTiming(sent_s=r.arrival_s)
                for t in positions[: r.output_len]:
                    timing.add(t, 1)
                timings.append(timing)
            useful += sum(r.output_len for r in batch)
            slots_x_positions += batch_size * new
            padding += sum(width - len(r.prompt_ids) + new - r.output_len for r in batch)
            computed += len(batch) * (width + new)
    finally:
        torch.set_num_threads(saved)
    steps = {
        "slot_utilization": round(useful / slots_x_positions, 4),
        "padding_fraction": round(padding / computed, 4),
        "num_steps": (len(requests) + batch_size - 1) // batch_size,  # generate calls
        "step_ms_mean": round(1000 * generate_s / (slots_x_positions / batch_size), 2),
        "num_padding_tokens": padding,
    }
    return policy_entry([r.kind for r in requests], timings, free_at, steps)


def vocab_size(model: str) -> int:
    from iterserve.workers.checkpoint import load_checkpoint

    return load_checkpoint(model).config.vocab_size


def compare(
    workload: str = "longtail",
    model: str | None = None,
    *,
    policies: tuple[str, ...] = POLICIES,
    hf: bool = True,
    seed: int = 0,
    torch_threads: int = 1,
    scale: str = "full",
    repeats: int | None = None,
    log=print,
) -> dict:
    """Runs ``workload`` under each policy and the transformers baseline, ``repeats``
    rounds; each figure is the median over the rounds."""
    from iterserve.bench.engine_bench import _default_model, ensure_ray

    model = model or _default_model()
    spec = SPECS[workload][scale]
    repeats = repeats or spec.repeats
    requests = build(spec, vocab_size(model), seed)
    expected = sum(r.output_len for r in requests)
    result = {"workload": describe(spec, requests, seed), "policies": {}}
    result["workload"].update(model=model, torch_threads=torch_threads, repeats=repeats)
    ensure_ray()
    # This process times every token: keep full collections of its start-up objects
    # (torch, Ray) out of the inter-token gaps it measures.
    freeze_startup_objects()
    # Rounds run every policy once, in the same order: a burst of load from elsewhere
    # on a shared machine then hits one round of all of them, and the median drops it.
    runs: dict[str, list[dict]] = {name: [] for name in (*policies, *(["hf_generate"] * hf))}
    for round_idx in range(repeats):
        for name in runs:
            log(f"[{workload}] {name} ({round_idx + 1}/{repeats}): {len(requests)} requests ...")
            if name == "hf_generate":
                entry = run_hf(model, requests, spec.max_num_seqs, torch_threads)
            else:
                config = engine_config(name, spec, model, torch_threads)
                entry = asyncio.run(run_policy(config, requests))
                entry["max_num_batched_tokens"] = config.max_num_batched_tokens
            entry["load_avg_1m"] = round(os.getloadavg()[0], 2)
            if entry["num_output_tokens"] != expected or entry["num_errors"]:
                # The same work everywhere, or the comparison means nothing.
                raise RuntimeError(
                    f"{name} produced {entry['num_output_tokens']} output tokens with "
                    f"{entry['num_errors']} errors; the workload asks for {expected}"
                )
            runs[name].append(entry)
            log(f"  {entry['throughput_tok_s']} tok/s over {entry['makespan_s']} s")
    for name, entries in runs.items():
        entry = median_entry(entries)
        if name == "hf_generate":
            result["hf_generate"] = entry
        else:
            result["policies"][name] = entry
    result["targets"] = targets(workload, result)
    return result


def main(args: argparse.Namespace) -> None:
    policies = tuple(p for p in (args.policies or ",".join(POLICIES)).split(",") if p)
    result = compare(
        args.workload, args.model, policies=policies, hf=not args.no_hf, seed=args.seed,
        torch_threads=args.torch_threads, scale=args.scale, repeats=args.repeats,
    )  # fmt: skip
    # Files first: a reader that stops reading stdout early must not lose them.
    write_json(result, args.json)
    if args.png:
        from iterserve.bench.plots import policy_plot

        policy_plot(result, args.png)
    print(render_policies(result))
    print(json.dumps(result, indent=2))


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``policies`` to the ``iterserve bench`` sub-commands."""
    parser = subparsers.add_parser(
        "policies", help="every batching policy and HF generate on one workload, side by side"
    )
    parser.add_argument("--workload", choices=sorted(SPECS), default="longtail")
    parser.add_argument("--model", help="checkpoint directory (default: the demo model)")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--png", help="write bar charts of the figures to this file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        help="rounds, figures are medians (default: 1 for longtail, 3 for long-prompts)",
    )
    parser.add_argument("--torch-threads", type=int, default=1, help="for the workers and HF")
    parser.add_argument("--policies", help="comma-separated subset (default: all four)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--scale", choices=["full", "small"], default="full",
                        help="small: a seconds-long smoke run of the same shape")  # fmt: skip
    parser.set_defaults(func=main)
    return parser
