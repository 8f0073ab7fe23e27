"""The batching lab: one workload, one model, one seed, every policy, one invocation.

Each policy serves the same requests through the real engine on Ray (scheduler
actor, rank actor, CPU, TP=1), arriving open-loop on the same schedule; then
Hugging Face ``generate`` serves them as the peer baseline. Every request has
``ignore_eos`` and ``max_tokens`` set to its drawn output length, so every run
computes exactly the same output tokens, which is asserted. Nothing here
asserts on time: the figures are printed side by side and written as JSON.
The workloads are in :mod:`iterserve.bench.workloads` (see docs/benchmarks.md
for why they look like this).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from ..cluster.config import EngineConfig
from ..cluster.gc_pauses import freeze_startup_objects
from ..scheduler import POLICIES, SamplingParams
from .hf_baseline import run_hf
from .report import (
    RequestTiming,
    forward_ms_per_step,
    median_entry,
    policy_entry,
    prometheus_values,
    render_policies,
    step_figures,
    targets,
    write_json,
)
from .workloads import SPECS, BenchRequest, Spec, build, describe

WALL_CAP_S = 1800.0  # one policy's run never outlives this, whatever the machine


def engine_config(policy: str, spec: Spec, model: str, torch_threads: int) -> EngineConfig:
    """The same slots, KV cache and threads for every policy; only the batching differs.
    Whole-prompt policies get twice max_model_len as their budget, so a step can always
    take the longest prompt; chunked gets a small budget so every step stays short."""
    return EngineConfig.from_dict(
        dict(
            model=model,
            dtype="float32",
            device="cpu",
            kernel_backend="torch",
            policy=policy,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.chunk_budget
            if policy == "chunked"
            else 2 * spec.max_model_len,
            max_model_len=spec.max_model_len,
            # Every slot can hold a full-length sequence: no policy ever preempts.
            num_kv_blocks=spec.max_num_seqs * (spec.max_model_len // 16 + 2),
            block_size=16,
            batch_timeout_s=spec.batch_timeout_s,
            batch_wait_s=spec.batch_wait_s,
            torch_threads=torch_threads,
            num_cpus_per_worker=1.0,
        )
    )


async def run_policy(config: EngineConfig, requests: list[BenchRequest]) -> dict:
    """Serves ``requests`` open-loop through a fresh engine; one policy's entry."""
    from ..cluster.engine.api import AsyncEngine

    engine = await AsyncEngine(config).start()
    try:
        # One short request first, so one-off costs (first kernels, allocator) stay out.
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        async for _ in engine.generate(requests[0].prompt_ids[:8], warm, request_id="warmup"):
            pass
        before = prometheus_values(await engine.actor.metrics_text.remote())
        timing_before = (await engine.stats())["timing"]
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
        timing_after = (await engine.stats())["timing"]
    finally:
        await engine.shutdown()
    makespan = max(t.chunks[-1][0] for t in timings if t.chunks)
    steps = step_figures(before, after, config.scheduler.max_num_seqs)
    steps["forward_ms_mean"] = round(forward_ms_per_step(timing_before, timing_after), 2)
    return policy_entry([r.kind for r in requests], timings, makespan, steps)


def vocab_size(model: str) -> int:
    from ..workers.checkpoint import load_checkpoint

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
    from .engine_bench import _default_model, ensure_ray

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
                entry["max_num_batched_tokens"] = config.scheduler.max_num_batched_tokens
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
        from .plots import policy_plot

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
    parser.add_argument("--torch-threads", type=int, default=1, help="for the ranks and HF")
    parser.add_argument("--policies", help="comma-separated subset (default: all four)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--scale", choices=["full", "small"], default="full",
                        help="small: a seconds-long smoke run of the same shape")  # fmt: skip
    parser.set_defaults(func=main)
    return parser
