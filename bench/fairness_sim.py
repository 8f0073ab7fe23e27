"""``iterserve simulate --workload fairness``: the scenario of ``bench fairness``
at the size a GPU cluster serves (the real scheduler, a virtual clock priced by
the roofline cost model of :mod:`.costmodel`; see :mod:`.simulator`).

A flood tenant posts ``flood_requests`` long prompts at t=0 while light tenants
send chat requests at a steady pace; the light tenants' TTFT p90 is set against
theirs with the machine to themselves, under each ``scheduling_policy``, and the
flood's output throughput against ``priority``'s. Then two heavy tenants, kept
backlogged with weights 2:1 and 1:1: the tokens computed for each per window
while both wait, read from ``fair``'s own counters.
"""

from __future__ import annotations

from ..scheduler import FakeExecutor, Request, SamplingParams, Scheduler, SchedulerConfig
from ..scheduler.config import SCHEDULING_POLICIES
from .costmodel import CostModel
from .fairness import Scenario, pair_figures
from .report import percentile
from .simulator import BLOCK_SIZE, CHUNKED_BUDGET, MAX_MODEL_LEN, _step_shape

# A deployment's sizes: 70B on 8 H200s, 256 slots, chunked prefill of 2048 tokens.
GPU_SCENARIO = Scenario(
    flood_requests=1024,
    flood_prompt=4000,
    flood_output=512,
    light_tenants=4,
    light_requests=40,
    light_prompt=200,
    light_output=128,
    light_interval_s=0.25,
    pair_requests=512,
    pair_prompt=2000,
    pair_output=256,
    window_s=5.0,
)
MAX_NUM_SEQS = 256


def _load(s: Scenario, *, flood: bool) -> list[tuple[float, str, int, int]]:
    """(arrival s, tenant, prompt tokens, output tokens) of every request."""
    load = []
    if flood:
        load += [(0.0, "flood", s.flood_prompt, s.flood_output)] * s.flood_requests
    for k in range(s.light_tenants):
        for j in range(s.light_requests):
            at = j * s.light_interval_s + k * s.light_interval_s / s.light_tenants
            load.append((at, f"light{k}", s.light_prompt, s.light_output))
    return load


def _run(
    cost: CostModel,
    load: list[tuple[float, str, int, int]],
    policy: str,
    tenants: dict | None = None,
    on_step=None,
) -> tuple[dict[str, list[float]], dict]:
    """Serves ``load`` to its end; returns each tenant's TTFTs and run figures.
    ``on_step(sched, now)`` sees the scheduler after every step."""
    config = SchedulerConfig(
        policy="chunked",
        scheduling_policy=policy,
        tenants=tenants or {},
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=CHUNKED_BUDGET,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_kv_blocks=cost.num_kv_blocks(BLOCK_SIZE),
        max_queue_len=len(load) + 1,
        max_queue_len_per_tenant=len(load) + 1 if policy == "fair" else None,
    )
    sched = Scheduler(config)
    ids = [f"req-{i}" for i in range(len(load))]
    output_len = {rid: out for rid, (_, _, _, out) in zip(ids, load)}
    executor = FakeExecutor(output_len=output_len.__getitem__, check_blocks=False)
    order = sorted(range(len(load)), key=lambda i: load[i][0])
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    tokens: dict[str, int] = {}
    slot_ctx: dict[int, int] = {}
    now, nxt, steps, step_s = 0.0, 0, 0, 0.0
    while nxt < len(load) or sched.has_work:
        while nxt < len(load) and load[order[nxt]][0] <= now:
            i = order[nxt]
            at, tenant, prompt_len, _ = load[i]
            prompt = [4 + i] + [3] * (prompt_len - 1)  # its own: nothing shared
            params = SamplingParams(max_tokens=load[i][3], ignore_eos=True)
            sched.add_request(Request(ids[i], prompt, params, arrival_time=at, tenant=tenant))
            nxt += 1
        step = sched.schedule(now)
        if step is None:
            if nxt >= len(load):
                raise RuntimeError(f"{policy}: work is waiting but nothing can run")
            now = load[order[nxt]][0]
            continue
        tokens_, context, causal, rows = _step_shape(step.plan, slot_ctx)
        took = cost.totals(tokens_, context, causal, rows).time_s
        now += took
        steps += 1
        step_s += took
        for out in sched.update(executor.execute(step.plan)).outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = now
        if on_step is not None:
            on_step(sched, now)
    ttft: dict[str, list[float]] = {}
    for rid, (at, tenant, _, _) in zip(ids, load):
        ttft.setdefault(tenant, []).append(first[rid] - at)
    flood_ids = [rid for rid, item in zip(ids, load) if item[1] == "flood"]
    figures = {"mean_step_ms": round(step_s / steps * 1000, 2), "steps": steps}
    if flood_ids:
        done = max(finish[r] for r in flood_ids)
        figures["flood_finished_s"] = round(done, 2)
        figures["flood_tok_s"] = round(sum(tokens[r] for r in flood_ids) / done, 1)
    return ttft, figures


def _p90_ms(values: list[float]) -> float:
    return round(percentile(values, 90) * 1000, 1)


def simulate_fairness(
    gpu: str = "h200", model: str = "70b", tp: int | None = None, scenario: Scenario = GPU_SCENARIO
) -> dict:
    """Each scheduling policy on the flood scenario, then fair's weighted pairs."""
    cost = CostModel(gpu, model, tp)
    results: dict = {}
    for policy in SCHEDULING_POLICIES:
        alone, _ = _run(cost, _load(scenario, flood=False), policy)
        flooded, figures = _run(cost, _load(scenario, flood=True), policy)
        light_alone = [t for k, v in alone.items() for t in v]
        light = [t for k, v in flooded.items() if k != "flood" for t in v]
        p90_alone, p90 = _p90_ms(light_alone), _p90_ms(light)
        results[policy] = {
            "light_ttft_p90_alone_ms": p90_alone,
            "light_ttft_p90_flood_ms": p90,
            "light_ttft_p90_ratio": round(p90 / p90_alone, 2),
            "light_ttft_p90_flood_steps": round(p90 / figures["mean_step_ms"], 1),
            "flood_ttft_p90_ms": _p90_ms(flooded["flood"]),
            **figures,
        }
    base = results["priority"]["flood_tok_s"]
    for figures in results.values():
        figures["flood_tok_s_vs_priority"] = round(figures["flood_tok_s"] / base, 3)
    pairs = {
        "pair_2_1": _pair(cost, scenario, {"gold": 2, "bronze": 1}),
        "pair_1_1": _pair(cost, scenario, {"a": 1, "b": 1}),
    }
    return {
        "gpu": gpu, "model": model, "tp": tp, "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": CHUNKED_BUDGET, "scenario": scenario.__dict__,
        "policies": results, "fair_pairs": pairs,
    }  # fmt: skip


def _pair(cost: CostModel, s: Scenario, weights: dict[str, float]) -> dict:
    """Two tenants backlogged under fair: computed tokens per ``window_s`` while both wait."""
    names = list(weights)
    load = [(0.0, name, s.pair_prompt, s.pair_output)
            for _ in range(s.pair_requests) for name in names]  # fmt: skip
    samples: list[tuple[float, dict[str, float]]] = []

    def watch(sched: Scheduler, now: float) -> None:
        waiting = sched.tenant_stats()
        if all(waiting.get(n, {}).get("waiting", 0) > 0 for n in names):
            counters = sched.waiting.counters()
            samples.append((now, {n: counters[n] * weights[n] for n in names}))

    tenants = {n: {"weight": w} for n, w in weights.items()}
    _run(cost, load, "fair", tenants, on_step=watch)
    figures = pair_figures(samples, weights, s.window_s)
    ratios, jains = figures["ratio_per_window"], figures["jain_per_window"]
    return {
        "weights": weights,
        "backlogged_s": figures["backlogged_s"],
        "windows": len(ratios),
        "ratio_min": min(ratios, default=None),
        "ratio_max": max(ratios, default=None),
        "jain_min": min(jains, default=None),
    }
