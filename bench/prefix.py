"""Prefix caching measured: one workload, the cache on and off, one invocation.

``iterserve bench prefix --workload shared-prefix|multi-turn``. Each mode gets a
fresh engine (scheduler actor and one rank actor on Ray, CPU, TP=1, chunked
prefill) that differs only in ``enable_prefix_caching``. With ``--routing`` the
two modes are instead two engine replicas with the cache on, the requests
spread over them by the ingress's :class:`PrefixRouter` or by load alone
(fewest requests in flight), as ``iterserve serve --routing`` does. The requests are the
same, greedy with ``ignore_eos`` and a fixed output length, so both modes
compute exactly the same tokens, which is checked token for token (in
multi-turn, every turn's prompt holds the answers before it). Nothing here
asserts on time: the figures are printed side by side, with their ratios.
The workloads are in :mod:`iterserve.bench.workloads`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from ..cluster.config import EngineConfig
from ..cluster.gc_pauses import freeze_startup_objects
from ..cluster.serve.routing import PrefixRouter, choose_replica
from ..scheduler import SamplingParams
from .report import (
    RequestTiming,
    format_table,
    median_entry,
    prometheus_values,
    summarize,
    write_json,
)
from .workloads import (
    PREFIX_SPECS,
    PrefixSpec,
    conversations,
    describe_prefix,
    shared_prefix_requests,
)

WALL_CAP_S = 1800.0  # one mode's run never outlives this, whatever the machine
# mode -> (prefix cache on, engine replicas, routing over them)
CACHE_MODES = {"cache_off": (False, 1, "load"), "cache_on": (True, 1, "load")}
ROUTING_MODES = {"routing_load": (True, 2, "load"), "routing_prefix": (True, 2, "prefix")}
TABLE = [
    ("throughput_tok_s", "out tok/s", ".1f"),
    ("total_throughput_tok_s", "total tok/s", ".1f"),
    ("request_throughput_req_s", "req/s", ".2f"),
    ("prefix_cache_hit_rate", "hit rate", ".3f"),
    ("num_prefill_tokens", "prefill tok", "d"),
    ("ttft_p50_s", "TTFT p50", ".3f"),
    ("ttft_p99_s", "TTFT p99", ".3f"),
    ("itl_p50_s", "ITL p50", ".3f"),
    ("e2e_p50_s", "E2E p50", ".2f"),
    ("makespan_s", "makespan", ".2f"),
    ("step_ms_mean", "ms/step", ".1f"),
]


def engine_config(
    spec: PrefixSpec, model: str, torch_threads: int, cache: bool, replicas: int = 1
) -> EngineConfig:
    return EngineConfig.from_dict(dict(
        model=model, dtype="float32", device="cpu", kernel_backend="torch", policy="chunked",
        max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.chunk_budget,
        max_model_len=spec.max_model_len, block_size=16,
        # Every slot holds a full-length sequence and the prefixes fit beside them:
        # neither mode preempts, and the cache only evicts what nobody repeats.
        num_kv_blocks=(spec.max_num_seqs + 4) * (spec.max_model_len // 16 + 2),
        enable_prefix_caching=cache, torch_threads=torch_threads,
        num_cpus_per_worker=1.0 / replicas,  # placed side by side on the machine's cores
    ))  # fmt: skip


class RoutedEngines:
    """Engine replicas behind one router, the way the ingress spreads requests:
    by the prompt's prefix (``router``) or, with None, to the fewest in flight."""

    def __init__(self, engines: list, router: PrefixRouter | None):
        self.engines = {f"engine{i}": engine for i, engine in enumerate(engines)}
        self.router = router
        self.in_flight = dict.fromkeys(self.engines, 0)

    async def generate(self, prompt: list[int], params: SamplingParams):
        name = choose_replica(self.router, prompt, self.in_flight)
        self.in_flight[name] += 1
        try:
            async for out in self.engines[name].generate(prompt, params):
                yield out
        finally:
            self.in_flight[name] -= 1


async def _stream(engine, prompt: list[int], output_len: int, timing: RequestTiming, start: float):
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tokens: list[int] = []
    async for out in engine.generate(prompt, params):
        timing.add(time.perf_counter() - start, len(out.token_ids))
        tokens.extend(out.token_ids)
    return tokens


async def _shared_prefix(engine, spec, vocab_size, seed, start):
    requests = shared_prefix_requests(spec, vocab_size, seed)

    async def one(req):
        await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
        timing = RequestTiming(sent_s=time.perf_counter() - start)
        return timing, await _stream(engine, req.prompt_ids, req.output_len, timing, start)

    done = await asyncio.gather(*map(one, requests))
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    return [t for t, _ in done], [out for _, out in done], prompt_tokens


async def _multi_turn(engine, spec, vocab_size, seed, start):
    chats = conversations(spec, vocab_size, seed)
    prompt_tokens = 0

    async def one(chat):
        nonlocal prompt_tokens
        await asyncio.sleep(max(0.0, start + chat.start_s - time.perf_counter()))
        history: list[int] = []
        turns = []
        for message in chat.messages:  # each turn right after the previous answer
            history = history + message
            prompt_tokens += len(history)
            timing = RequestTiming(sent_s=time.perf_counter() - start)
            answer = await _stream(engine, history, chat.output_len, timing, start)
            turns.append((timing, answer))
            history = history + answer
        return turns

    done = [turn for chat in await asyncio.gather(*map(one, chats)) for turn in chat]
    return [t for t, _ in done], [out for _, out in done], prompt_tokens


async def _metrics(engines: list) -> dict:
    """The engines' metrics, summed over them."""
    total: dict = {}
    for engine in engines:
        for key, value in prometheus_values(await engine.actor.metrics_text.remote()).items():
            total[key] = total.get(key, 0.0) + value
    return total


async def run_mode(
    config: EngineConfig,
    spec: PrefixSpec,
    vocab_size: int,
    seed: int,
    replicas: int = 1,
    routing: str = "load",
) -> tuple[dict, list]:
    """Serves the workload through fresh engines; one mode's entry and its outputs."""
    from ..cluster.engine.api import AsyncEngine

    engines = [await AsyncEngine(config).start() for _ in range(replicas)]
    try:
        # A short unrelated request first: one-off costs stay out, no prefix goes in.
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        for engine in engines:
            async for _ in engine.generate([vocab_size - 1] * 8, warm):
                pass
        router = PrefixRouter(config.scheduler.block_size) if routing == "prefix" else None
        target = engines[0] if replicas == 1 else RoutedEngines(engines, router)
        before = await _metrics(engines)
        start = time.perf_counter()
        drive = _shared_prefix if spec.name == "shared-prefix" else _multi_turn
        timings, outputs, prompt_tokens = await asyncio.wait_for(
            drive(target, spec, vocab_size, seed, start), WALL_CAP_S
        )
        after = await _metrics(engines)
    finally:
        for engine in engines:
            await engine.shutdown()
    return mode_entry(timings, prompt_tokens, before, after), outputs


def mode_entry(timings: list[RequestTiming], prompt_tokens: int, before: dict, after: dict):
    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    makespan = max(t.chunks[-1][0] for t in timings if t.chunks) - min(t.sent_s for t in timings)
    entry = summarize(timings, makespan)
    queries = delta("iterserve_prefix_cache_queries_total")
    steps = delta("iterserve_step_duration_seconds_count")
    entry.update(
        num_prompt_tokens=prompt_tokens,
        total_throughput_tok_s=round((prompt_tokens + entry["num_output_tokens"]) / makespan, 2),
        num_prefill_tokens=int(delta("iterserve_step_tokens_sum", kind="prefill")),
        prefix_cache_hit_rate=round(delta("iterserve_prefix_cache_hits_total") / queries, 4)
        if queries else 0.0,
        num_steps=int(steps),
        step_ms_mean=round(1000 * delta("iterserve_step_duration_seconds_sum") / steps, 2)
        if steps else 0.0,
    )  # fmt: skip
    return entry


def ratios(result: dict) -> dict:
    """The second mode's figures over the first's: cache on / off, or prefix-aware
    routing / load-only routing."""
    names = list(result["modes"])
    base, test = result["modes"][names[0]], result["modes"][names[1]]
    tag = "on_over_off" if names[0] == "cache_off" else "prefix_over_load"

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    return {
        f"ttft_p50_{tag}": ratio(test["ttft_p50_s"], base["ttft_p50_s"]),
        f"ttft_p99_{tag}": ratio(test["ttft_p99_s"], base["ttft_p99_s"]),
        f"throughput_{tag}": ratio(test["throughput_tok_s"], base["throughput_tok_s"]),
        f"prefill_tokens_{tag}": ratio(test["num_prefill_tokens"], base["num_prefill_tokens"]),
    }


def targets(workload: str, r: dict) -> list[dict]:
    if workload != "shared-prefix" or "ttft_p50_on_over_off" not in r:
        return []
    rows = [("TTFT p50, cache on / off", r["ttft_p50_on_over_off"], "<= 0.25", lambda v: v <= 0.25),
            ("throughput, cache on / off", r["throughput_on_over_off"], ">= 2", lambda v: v >= 2)]  # fmt: skip
    return [{"name": n, "value": v, "target": t, "met": bool(ok(v))}
            for n, v, t, ok in rows if v is not None]  # fmt: skip


def compare(workload="shared-prefix", model=None, *, seed=0, torch_threads=1, scale="full",
            repeats=None, routing=False, log=print) -> dict:  # fmt: skip
    """Runs ``workload`` with the cache off and on (``routing``: over two replicas
    routed by load, then by prefix), ``repeats`` rounds (each mode once per round,
    in the same order); each figure is the median over the rounds."""
    from .engine_bench import _default_model, ensure_ray
    from .policies import vocab_size as checkpoint_vocab

    model = model or _default_model()
    spec = PREFIX_SPECS[workload][scale]
    repeats = repeats or spec.repeats
    vocab = checkpoint_vocab(model)
    ensure_ray()
    freeze_startup_objects()  # this process times every token
    modes = ROUTING_MODES if routing else CACHE_MODES
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    reference = None
    for round_idx in range(repeats):
        for name, (cache, replicas, how) in modes.items():
            log(f"[{workload}] {name} ({round_idx + 1}/{repeats}) ...")
            config = engine_config(spec, model, torch_threads, cache, replicas)
            entry, outputs = asyncio.run(run_mode(config, spec, vocab, seed, replicas, how))
            entry["load_avg_1m"] = round(os.getloadavg()[0], 2)
            if entry["num_errors"] or (reference is not None and outputs != reference):
                # The same tokens in every mode, or the comparison means nothing.
                raise RuntimeError(f"{name}: outputs differ from the first run's, or failed")
            reference = outputs
            runs[name].append(entry)
            log(f"  {entry['throughput_tok_s']} tok/s, TTFT p50 {entry['ttft_p50_s']} s")
    result = {"workload": {**describe_prefix(spec, seed), "model": model,
                           "torch_threads": torch_threads, "repeats": repeats,
                           "engine_replicas": 2 if routing else 1},
              "modes": {name: median_entry(entries) for name, entries in runs.items()}}  # fmt: skip
    result["ratios"] = ratios(result)
    result["targets"] = targets(workload, result["ratios"])
    return result


def render(result: dict) -> str:
    lines = [format_table(result["modes"], TABLE), ""]
    lines += [f"{name}: {value}" for name, value in result["ratios"].items()]
    for t in result["targets"]:
        lines.append(f"{t['name']}: {t['value']} (target {t['target']}) "
                     f"{'met' if t['met'] else 'MISSED'}")  # fmt: skip
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    result = compare(args.workload, args.model, seed=args.seed, torch_threads=args.torch_threads,
                     scale=args.scale, repeats=args.repeats, routing=args.routing)  # fmt: skip
    write_json(result, args.json)
    print(render(result))
    print(json.dumps(result, indent=2))


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``prefix`` to the ``iterserve bench`` sub-commands."""
    p = subparsers.add_parser("prefix", help="one workload with the prefix cache on and off")
    p.add_argument("--workload", choices=sorted(PREFIX_SPECS), default="shared-prefix")
    p.add_argument("--model", help="checkpoint directory (default: the demo model)")
    p.add_argument("--json", help="also write the result to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, help="rounds of both modes; figures are medians")
    p.add_argument("--torch-threads", type=int, default=1, help="the rank's torch threads")
    p.add_argument("--routing", action="store_true",
                   help="two engine replicas, the cache on: prefix-aware routing vs by load")  # fmt: skip
    p.add_argument("--scale", choices=["full", "small"], default="full",
                   help="small: a seconds-long smoke run of the same shape")  # fmt: skip
    p.set_defaults(func=main)
    return p
