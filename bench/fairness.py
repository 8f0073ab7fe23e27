"""Fairness between tenants: one flood against light tenants' chat, under each
``scheduling_policy``, on one engine.

Two scenarios, each under every policy asked for, the policies alternating:

- ``flood``: a heavy tenant posts ``flood_requests`` long prompts at once; light
  tenants send short requests, one every ``light_interval_s`` each. The light
  tenants' TTFT p90 is set against the same requests with the engine to
  themselves (``alone``), in milliseconds and in the flood's steps (TTFT ÷ the
  mean step time under the flood); the flood's output throughput against
  ``priority``'s.
- ``single``: the flood alone, one tenant: what a policy costs where nobody shares.
- ``pair``: two heavy tenants kept backlogged, weights 2:1 (then 1:1): the tokens
  the engine computed for each over every ``window_s`` window while both wait,
  their ratio, and Jain's index over their weighted service
  (``(Σx)² / (n Σx²)``: 1 is an even share, 1/n one tenant served alone).

The engine is a fresh in-process one per run (``AsyncEngine``, the demo model by
default, the engine's defaults otherwise), or a server already running
(``--url``: it serves whatever policy it was started with; run it once per
policy). Every request has ``ignore_eos``, so every policy computes the same
tokens. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, replace

from ..scheduler.config import SCHEDULING_POLICIES
from .report import RequestTiming, percentile

FLOOD, PAIR = "flood", "pair"


@dataclass(frozen=True)
class Scenario:
    """Sizes in tokens; the defaults are issue 43's measurement on a CPU."""

    flood_requests: int = 64
    flood_prompt: int = 1000
    flood_output: int = 192
    light_tenants: int = 1
    light_requests: int = 12
    light_prompt: int = 28  # a 20-word question
    light_output: int = 32
    light_interval_s: float = 0.4
    pair_requests: int = 400  # each heavy tenant's, all at once
    pair_prompt: int = 800
    pair_output: int = 32
    window_s: float = 5.0


def jain(values: list[float]) -> float | None:
    """Jain's fairness index of ``values`` (None when all are zero or there are none)."""
    total, squares = sum(values), sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else None


# Prompt token ids: drawn from a range every vocabulary has, past the special tokens.
TOKEN_IDS = (100, 1000)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_IDS) for _ in range(n)]


def _summary(timings: list[RequestTiming]) -> dict:
    done = [t for t in timings if t.error is None and t.chunks]
    out = {"requests": len(timings), "failed": len(timings) - len(done)}
    for name in ("ttft", "e2e"):
        values = [getattr(t, f"{name}_s") for t in done]
        for q in (50, 90, 99):
            value = percentile(values, q)
            out[f"{name}_p{q}_ms"] = None if value is None else round(value * 1000, 1)
    return out


# -- targets: an in-process engine, or a running server ------------------------------


class EngineTarget:
    """A fresh in-process engine with ``config`` (an EngineConfig's flat mapping)."""

    def __init__(self, config: dict):
        self.config = config
        self.engine = None

    async def __aenter__(self):
        from ..cluster.config import EngineConfig
        from ..cluster.engine.api import AsyncEngine

        self.engine = await AsyncEngine(EngineConfig.from_dict(self.config)).start()
        return self

    async def __aexit__(self, *exc):
        await self.engine.shutdown()

    async def send(self, prompt: list[int], max_tokens: int, tenant: str, t0: float):
        from ..scheduler import SamplingParams

        timing = RequestTiming(sent_s=time.perf_counter() - t0)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        try:
            async for out in self.engine.generate(prompt, params, tenant=tenant):
                timing.add(time.perf_counter() - t0, len(out.token_ids))
        except Exception as exc:  # counted, not raised: a refusal is a figure too
            timing.error = type(exc).__name__
        return timing

    async def stats(self) -> dict:
        return await self.engine.stats()


class HttpTarget:
    """A server already running at ``url`` (its /v1/completions and /v1/stats)."""

    def __init__(self, url: str, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def __aenter__(self):
        import httpx

        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(headers=self.headers, limits=limits, timeout=1800)
        models = (await self.client.get(f"{self.url}/v1/models")).json()["data"]
        self.model = models[0]["id"]
        return self

    async def __aexit__(self, *exc):
        await self.client.aclose()

    async def send(self, prompt: list[int], max_tokens: int, tenant: str, t0: float):
        from .loadgen import _stream_one

        timing = RequestTiming(sent_s=time.perf_counter() - t0)
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0.0, "user": tenant,
                "stream_options": {"include_usage": True}}  # fmt: skip
        try:
            await _stream_one(self.client, self.url, body, timing, t0)
        except Exception as exc:
            timing.error = type(exc).__name__
        return timing

    async def stats(self) -> dict:
        stats = (await self.client.get(f"{self.url}/v1/stats")).json()
        replica = stats["replicas"][0] if stats.get("replicas") else {}
        return {"tenants": stats.get("tenants", {}), "timing": replica.get("timing", {}),
                "scheduling_policy": replica.get("scheduling_policy")}  # fmt: skip


# -- the scenarios -----------------------------------------------------------------------


async def warm_up(target, s: Scenario) -> None:
    """One long prompt and one short, so that one-off costs (a kernel's first call
    at a shape) stay out of the figures."""
    rng = random.Random(-1)
    await asyncio.gather(
        target.send(_prompt(rng, s.flood_prompt), 2, "warm-up", time.perf_counter()),
        target.send(_prompt(rng, s.light_prompt), 2, "warm-up", time.perf_counter()),
    )


async def run_flood(target, s: Scenario, *, flood: bool, seed: int = 0) -> dict:
    """The light tenants' requests, with the flood posted just before them or not.
    A light TTFT in flood steps divides it by the mean step while the light
    tenants were sending (the flood's prefill, then: its longest steps). Each
    run's prompts are its own (``seed``): nothing is found in the prefix cache."""
    rng = random.Random(seed)
    before = (await target.stats())["timing"]
    t0 = time.perf_counter()
    flood_sends = [
        target.send(_prompt(rng, s.flood_prompt), s.flood_output, "flood", t0)
        for _ in range(s.flood_requests if flood else 0)
    ]
    light_sends = [
        _later(j * s.light_interval_s + k * s.light_interval_s / s.light_tenants,
               target.send, _prompt(rng, s.light_prompt), s.light_output, f"light{k}", t0)
        for k in range(s.light_tenants) for j in range(s.light_requests)
    ]  # fmt: skip
    flood_task = asyncio.ensure_future(asyncio.gather(*flood_sends))
    light = await asyncio.gather(*light_sends)
    during = (await target.stats())["timing"]
    flood_timings = await flood_task
    result = {"light": _summary(light), "mean_step_ms": _mean_step_ms(before, during)}
    if flood:
        after = (await target.stats())["timing"]
        done = [t for t in flood_timings if t.chunks]
        ends = [t.chunks[-1][0] for t in done]
        tokens = sum(t.num_tokens for t in done)
        result["flood"] = _summary(flood_timings)
        result["flood_finished_s"] = round(max(ends), 2) if ends else None
        result["flood_tok_s"] = round(tokens / max(ends), 1) if ends else None
        result["flood_mean_step_ms"] = _mean_step_ms(before, after)
        ttft, step = result["light"]["ttft_p90_ms"], result["mean_step_ms"]
        result["light_ttft_p90_steps"] = round(ttft / step, 1) if ttft and step else None
    return result


def _mean_step_ms(before: dict, after: dict) -> float | None:
    """The mean step between two of an engine's ``timing`` snapshots."""
    steps = after.get("steps", 0) - before.get("steps", 0)
    step_s = after.get("step_s", 0.0) - before.get("step_s", 0.0)
    return _ms(step_s / steps) if steps else None


async def _later(at: float, send, *args):
    await asyncio.sleep(at)
    return await send(*args)


async def run_pairs(target, s: Scenario, r: int) -> dict:
    """The pair at weights 2:1 (a server started with ``tenants`` gold: 2, bronze: 1)
    and at 1:1."""
    return {
        "pair_2_1": await run_pair(target, s, {"gold": 2, "bronze": 1}, seed=5 * r + 3),
        "pair_1_1": await run_pair(target, s, {"a": 1, "b": 1}, seed=5 * r + 4),
    }


async def run_pair(target, s: Scenario, weights: dict[str, float], seed: int) -> dict:
    """Two heavy tenants backlogged at once: the tokens computed for each per window
    while both wait (from the fair policy's own counters when it runs, else from
    the tokens the engine reports served)."""
    rng = random.Random(seed)
    names = list(weights)
    t0 = time.perf_counter()
    sends = [target.send(_prompt(rng, s.pair_prompt), s.pair_output, name, t0)
             for _ in range(s.pair_requests) for name in names]  # fmt: skip
    samples: list[tuple[float, dict]] = []
    done = asyncio.ensure_future(asyncio.gather(*sends))
    while not done.done():
        stats = (await target.stats())["tenants"]
        samples.append((time.perf_counter() - t0, stats))
        await asyncio.wait([done], timeout=0.25)
    await done

    def computed(stats: dict, name: str) -> float:
        figures = stats.get(name, {})
        if "served" in figures:  # fair's counter: tokens / weight
            return figures["served"] * weights[name]
        return figures.get("served_tokens", 0)

    # Both backlogged: both have requests waiting.
    backlogged = [
        (t, {n: computed(stats, n) for n in names})
        for t, stats in samples
        if all(stats.get(n, {}).get("waiting", 0) > 0 for n in names)
    ]
    return pair_figures(backlogged, weights, s.window_s)


def pair_figures(
    samples: list[tuple[float, dict[str, float]]], weights: dict[str, float], window_s: float
) -> dict:
    """From ``(time, tokens computed so far per tenant)`` samples taken while both
    tenants wait: the tokens of each per ``window_s`` window, their ratio (first
    tenant / second), and Jain's index over their weighted service."""
    names = list(weights)
    windows = []
    if samples:
        start, first = samples[0]
        for t, served in samples[1:]:
            if t - start >= window_s:
                windows.append({n: served[n] - first[n] for n in names})
                start, first = t, served
    ratios = [w[names[0]] / w[names[1]] for w in windows if w[names[1]] > 0]
    jains = [jain([w[n] / weights[n] for n in names]) for w in windows]
    return {
        "weights": weights,
        "backlogged_s": round(samples[-1][0] - samples[0][0], 1) if samples else 0.0,
        "windows": [{n: round(w[n]) for n in names} for w in windows],
        "ratio_per_window": [round(r, 3) for r in ratios],
        "jain_per_window": [round(j, 4) for j in jains if j is not None],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


async def compare(
    policies: tuple[str, ...], scenario: Scenario, rounds: int, base: dict, url: str | None
) -> dict:
    """Every scenario under every policy (alternating), ``rounds`` times; with ``url``,
    under the one policy that server runs."""
    runs: dict[str, list[dict]] = {}
    for r in range(rounds):
        for policy in policies if url is None else ("served",):
            if url is None:
                config = {**base, "scheduling_policy": policy}
                target = EngineTarget(config)
            else:
                target = HttpTarget(url)
            async with target:
                if url is not None:
                    policy = (await target.stats()).get("scheduling_policy") or "unknown"
                await warm_up(target, scenario)
                entry = {
                    "round": r,
                    "alone": await run_flood(target, scenario, flood=False, seed=5 * r),
                    "flood": await run_flood(target, scenario, flood=True, seed=5 * r + 1),
                    # One tenant alone: what the policy costs where there is nobody to share with.
                    "single": await run_flood(
                        target, replace(scenario, light_tenants=0), flood=True, seed=5 * r + 2
                    ),  # fmt: skip
                }
                if policy == "fair" and url is not None:  # a server with gold:2, bronze:1
                    entry.update(await run_pairs(target, scenario, r))
            if policy == "fair" and url is None:
                tenants = {"gold": {"weight": 2}, "bronze": {"weight": 1}}
                async with EngineTarget({**config, "tenants": tenants}) as target:
                    entry.update(await run_pairs(target, scenario, r))
            runs.setdefault(policy, []).append(entry)
            print(f"[round {r}] {policy}: {_line(entry)}", flush=True)
    return {"scenario": asdict(scenario), "base_config": base, "url": url, "runs": runs,
            "summary": summarize(runs)}  # fmt: skip


def _line(entry: dict) -> str:
    alone, flood = entry["alone"]["light"], entry["flood"]
    return (f"light TTFT p90 alone {alone['ttft_p90_ms']} ms, under the flood "
            f"{flood['light']['ttft_p90_ms']} ms ({flood['light_ttft_p90_steps']} steps); "
            f"flood {flood['flood_tok_s']} tok/s, done at {flood['flood_finished_s']} s; "
            f"one tenant alone {entry['single']['flood_tok_s']} tok/s")  # fmt: skip


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(percentile(values, 50), 2) if values else None


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Medians over the rounds, and the issue's ratios."""
    out: dict = {}
    for policy, entries in runs.items():
        alone = _median([e["alone"]["light"]["ttft_p90_ms"] for e in entries])
        flood = _median([e["flood"]["light"]["ttft_p90_ms"] for e in entries])
        out[policy] = {
            "light_ttft_p90_alone_ms": alone,
            "light_ttft_p90_flood_ms": flood,
            "light_ttft_p90_ratio": round(flood / alone, 2) if alone and flood else None,
            "light_ttft_p90_flood_steps": _median(
                [e["flood"]["light_ttft_p90_steps"] for e in entries]
            ),
            # The rest of the percentiles under the flood: the light tenant's whole
            # requests, and the flood's own first tokens and requests.
            **{
                f"{who}_{name}_p{q}_flood_ms": _median(
                    [e["flood"][who][f"{name}_p{q}_ms"] for e in entries]
                )
                for who in ("light", "flood")
                for name in ("ttft", "e2e")
                for q in (50, 90, 99)
                if (who, name, q) != ("light", "ttft", 90)  # that one: above
            },
            "flood_tok_s": _median([e["flood"]["flood_tok_s"] for e in entries]),
            "single_tenant_tok_s": _median([e["single"]["flood_tok_s"] for e in entries]),
            "flood_finished_s": _median([e["flood"]["flood_finished_s"] for e in entries]),
            "mean_step_ms": _median([e["flood"]["mean_step_ms"] for e in entries]),
        }
        for pair in ("pair_2_1", "pair_1_1"):
            ratios = [r for e in entries for r in e.get(pair, {}).get("ratio_per_window", [])]
            jains = [j for e in entries for j in e.get(pair, {}).get("jain_per_window", [])]
            if ratios or jains:
                out[policy][pair] = {
                    "ratio_min": min(ratios, default=None),
                    "ratio_max": max(ratios, default=None),
                    "jain_min": min(jains, default=None),
                    "windows": len(ratios),
                }
    for key in ("flood_tok_s", "single_tenant_tok_s"):
        base = out.get("priority", {}).get(key)
        for figures in out.values():
            tok_s = figures[key]
            figures[f"{key}_vs_priority"] = round(tok_s / base, 3) if base and tok_s else None
    return out


def render(result: dict) -> str:
    rows = [
        "policy    light TTFT p90: alone / flood (ratio, flood steps)   flood tok/s (vs priority)"
    ]
    for policy, f in result["summary"].items():
        rows.append(
            f"{policy:9} {f['light_ttft_p90_alone_ms']} / {f['light_ttft_p90_flood_ms']} ms "
            f"({f['light_ttft_p90_ratio']}x, {f['light_ttft_p90_flood_steps']} steps)   "
            f"{f['flood_tok_s']} ({f['flood_tok_s_vs_priority']}); one tenant alone "
            f"{f['single_tenant_tok_s']} ({f['single_tenant_tok_s_vs_priority']})"
        )
        rows.append(
            "          under the flood, p50 / p90 / p99 ms: light TTFT "
            + _percentiles(f, "light", "ttft") + ", E2E " + _percentiles(f, "light", "e2e")
            + "; flood TTFT " + _percentiles(f, "flood", "ttft")
            + ", E2E " + _percentiles(f, "flood", "e2e")
        )  # fmt: skip
        for pair in ("pair_2_1", "pair_1_1"):
            if pair in f:
                p = f[pair]
                rows.append(f"          {pair}: ratio {p['ratio_min']}..{p['ratio_max']} over "
                            f"{p['windows']} windows, Jain's index >= {p['jain_min']}")  # fmt: skip
    return "\n".join(rows)


def _percentiles(figures: dict, who: str, name: str) -> str:
    return " / ".join(str(figures[f"{who}_{name}_p{q}_flood_ms"]) for q in (50, 90, 99))


def plot(result: dict, path: str) -> None:
    """Light TTFT p90 alone and under the flood, and the flood's tokens/s, by policy."""
    from .plots import _pyplot

    plt = _pyplot()
    summary = result["summary"]
    policies = list(summary)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    xs = range(len(policies))
    left.bar([x - 0.2 for x in xs], [summary[p]["light_ttft_p90_alone_ms"] or 0 for p in policies],
             0.4, label="alone")  # fmt: skip
    left.bar([x + 0.2 for x in xs], [summary[p]["light_ttft_p90_flood_ms"] or 0 for p in policies],
             0.4, label="under the flood")  # fmt: skip
    left.set_yscale("log")
    left.set_ylabel("light tenant TTFT p90 (ms)")
    right.bar(list(xs), [summary[p]["flood_tok_s"] or 0 for p in policies], 0.5)
    right.set_ylabel("flood output tokens/s")
    for ax in (left, right):
        ax.set_xticks(list(xs), policies)
        ax.grid(alpha=0.3, axis="y")
    left.legend()
    fig.suptitle("bench fairness: a flood tenant and light tenants on one engine")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> None:
    policies = tuple(p for p in args.policies.split(",") if p)
    for policy in policies:
        if policy not in SCHEDULING_POLICIES:
            raise SystemExit(
                f"--policies: {policy!r} is not one of {', '.join(SCHEDULING_POLICIES)}"
            )
    fields = {
        f: getattr(args, f)
        for f in Scenario.__dataclass_fields__
        if getattr(args, f, None) is not None
    }
    scenario = Scenario(**fields)
    base = json.loads(args.config) if args.config else {}
    if args.model:
        base["model"] = args.model
    result = asyncio.run(compare(policies, scenario, args.rounds, base, args.url))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    if args.png:
        plot(result, args.png)
    print(render(result))


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``fairness`` to the ``iterserve bench`` sub-commands."""
    parser = subparsers.add_parser(
        "fairness", help="a flood tenant against light tenants, under each scheduling_policy"
    )
    parser.add_argument("--model", help="checkpoint directory (default: the demo model)")
    parser.add_argument("--config", help="engine config keys as JSON, for every run")
    parser.add_argument("--url", help="drive a running server instead (its own policy)")
    parser.add_argument("--policies", default="priority,fcfs,fair")
    parser.add_argument("--rounds", type=int, default=1, help="policies alternate each round")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--png", help="write the figure to this file")
    for name, spec in Scenario.__dataclass_fields__.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(spec.default),
                            help=f"(default: {spec.default})")  # fmt: skip
    parser.set_defaults(func=main)
    return parser
