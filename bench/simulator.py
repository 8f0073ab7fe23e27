"""Drives the real :class:`Scheduler` over a virtual clock priced by a GPU cost model.

Each step: the scheduler plans it at virtual time ``now``, the
:class:`FakeExecutor` produces its result (tokens, EOS after the sampled output
length), and the clock advances by the roofline time of the plan
(:mod:`iterserve.bench.costmodel`). When nothing can run, the clock jumps to
the next arrival or to the scheduler's ``next_deadline()`` (a batch timeout).
Tokens are stamped with the time their step ends. Nothing runs on a GPU, so the
sizes are those of a real deployment (256 slots, 8k context, a 70B model).

Per-policy token budgets (``max_num_batched_tokens``), see ``BUDGETS``:

- static / dynamic: ``max_num_seqs x max_model_len``, so the budget never splits
  a batch: a batch is up to ``max_num_seqs`` requests (as many as their reserved
  worst-case KV allows), all padded to its longest prompt in one prefill step,
  as naive padded batching does; that padded prefill is priced in full.
- continuous: ``max_model_len`` (8192), the budget a server that prefills whole
  prompts must have to admit its longest prompt.
- chunked: 2048, a small budget so that every step stays short whatever
  arrives; prompts beyond it are prefilled in pieces alongside the decodes.

Prefix caching is modelled by the scheduler itself: a request admitted on
cached blocks starts its prefill there, and the cost model prices what the
plan computes (its attention still reads the cached context). Prompt token ids
only decide what is shared: each request's prompt is its own, except for the
system prompt a ``shared-prefix`` load gives it
(:mod:`iterserve.bench.prefix_sim`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ..scheduler import (
    POLICIES,
    FakeExecutor,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from .costmodel import CostModel

MAX_MODEL_LEN = 8192
MAX_TOKENS = 2048  # every request's cap: EOS, not the cap, ends almost all of them
CHUNKED_BUDGET = 2048
BLOCK_SIZE = 16
# Speculation's outputs repeat with this period, so that prompt lookup always proposes
# (whether a proposal is accepted is drawn: ``acceptance``).
SPEC_PERIOD = 8

# Default sizes: the four policies together simulate in well under a minute on one core.
NUM_REQUESTS = 2000
# Above what any preset serves with continuous batching (~30-35 requests/s of this
# mix for 8B on one H200), so every policy is measured saturated: throughput is
# capacity, and TTFT / end-to-end latency include the queue that builds up.
REQUEST_RATE = 50.0

# The long-tail mix (all lengths in tokens).
CHAT_PROMPT = (50, 300)  # uniform
LONG_PROMPT = (1000, 4000)  # uniform, RAG-style
LONG_FRACTION = 0.2
OUTPUT_MEDIAN = 128  # lognormal output lengths, clipped to [1, MAX_TOKENS]
OUTPUT_SIGMA = 1.1


def budgets(max_num_seqs: int, max_model_len: int = MAX_MODEL_LEN) -> dict[str, int]:
    """Default ``max_num_batched_tokens`` per policy (see the module docstring)."""
    return {
        "static": max_num_seqs * max_model_len,
        "dynamic": max_num_seqs * max_model_len,
        "continuous": max(max_model_len, max_num_seqs),
        "chunked": max(CHUNKED_BUDGET, max_num_seqs),
    }


def workload(
    num_requests: int = NUM_REQUESTS,
    request_rate: float = REQUEST_RATE,
    seed: int = 0,
    long_fraction: float = LONG_FRACTION,
) -> dict[str, list]:
    """Seeded Poisson arrivals with long-tail prompt and output lengths.

    ``request_rate`` is in requests/s; ``math.inf`` puts every arrival at t=0.
    Returns parallel lists ``arrival_s``, ``prompt_len`` and ``output_len``.
    """
    rng = np.random.default_rng(seed)
    if math.isinf(request_rate):
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / request_rate, num_requests))
    long = rng.random(num_requests) < long_fraction
    chat = rng.integers(CHAT_PROMPT[0], CHAT_PROMPT[1] + 1, num_requests)
    rag = rng.integers(LONG_PROMPT[0], LONG_PROMPT[1] + 1, num_requests)
    prompts = np.where(long, rag, chat)
    outputs = rng.lognormal(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA, num_requests)
    outputs = np.clip(np.rint(outputs), 1, MAX_TOKENS).astype(int)
    return {
        "arrival_s": arrivals.tolist(),
        "prompt_len": prompts.tolist(),
        "output_len": outputs.tolist(),
    }


SYSTEM_TOKEN = 1 << 30  # a shared-prefix load's system prompt k: this token id + k, repeated


def _prompt(load: dict[str, list], i: int) -> list[int]:
    """Request ``i``'s token ids: only equality matters (what the cache shares). Its own
    first token keeps a prompt apart; a shared-prefix load starts it with its
    system prompt's."""
    own = [4 + i] + [3] * (load["prompt_len"][i] - 1)
    if "prefix_id" not in load:
        return own
    shared = load["prefix_len"][i]
    return [SYSTEM_TOKEN + load["prefix_id"][i]] * shared + own[: load["prompt_len"][i] - shared]


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class _Timeline:
    """When each request arrived, got its first and last token, and finished."""

    def __init__(self, arrival: dict[str, float]):
        self.arrival = arrival
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.finish: dict[str, float] = {}
        self.num_out = dict.fromkeys(arrival, 0)
        self.itl: list[float] = []

    def record(self, outputs: list, now: float) -> None:
        for out in outputs:
            rid = out.request_id
            if out.new_token_ids:
                if rid in self.first:
                    self.itl.append(now - self.last[rid])
                else:
                    self.first[rid] = now
                self.last[rid] = now
                self.num_out[rid] += len(out.new_token_ids)
            if out.finished:
                self.finish[rid] = now

    def latencies(self) -> dict:
        ids, first, finish, num_out = self.arrival, self.first, self.finish, self.num_out
        ttft = [first[r] - self.arrival[r] for r in ids]
        e2e = [finish[r] - self.arrival[r] for r in ids]
        tpot = [(finish[r] - first[r]) / (num_out[r] - 1) for r in ids if num_out[r] > 1]
        metrics = {}
        for name, values in (("ttft", ttft), ("itl", self.itl), ("e2e", e2e)):
            for q in (50, 90, 99):
                metrics[f"{name}_p{q}_s"] = _pct(values, q)
        metrics["tpot_p50_s"] = _pct(tpot, 50)
        return metrics


def _step_shape(plan, slot_ctx: dict[int, int]) -> tuple[int, int, int, int]:
    """Tokens, attended context, causal pairs and sampled rows of one step, for the
    cost model; ``slot_ctx`` tracks each slot's context (a padding slot keeps
    attending over its own KV)."""
    tokens = context = causal = rows = 0
    for e in plan.scheduled:
        s, n = e.start_pos, e.num_tokens + e.num_pad_tokens
        tokens += n
        context += s + n
        causal += n * s + n * (n + 1) // 2
        rows += e.sample * (1 + e.num_draft_tokens)  # a draft samples after each row
        slot_ctx[e.slot_idx] = s + n
    for slot in plan.padding_slots:
        c = slot_ctx[slot] = slot_ctx[slot] + 1
        tokens += 1
        context += c
        causal += c
        rows += 1
    return tokens, context, causal, rows


def simulate_policy(
    policy: str,
    cost: CostModel,
    load: dict[str, list],
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    max_model_len: int = MAX_MODEL_LEN,
    max_tokens: int = MAX_TOKENS,
    enable_prefix_caching: bool = True,
    speculative_config: dict | None = None,
    acceptance: float | None = None,
) -> dict:
    """Runs one policy over ``load`` (as :func:`workload` or :func:`prefix_workload`
    returns) to completion. With ``speculative_config`` (prompt lookup), outputs
    repeat with a short period so that proposals are always made, and each is
    accepted with probability ``acceptance`` (after those before it)."""
    if max_num_batched_tokens is None:
        max_num_batched_tokens = budgets(max_num_seqs, max_model_len)[policy]
    num_requests = len(load["arrival_s"])
    config = SchedulerConfig(
        policy=policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        num_kv_blocks=cost.num_kv_blocks(BLOCK_SIZE),
        max_queue_len=num_requests,
        enable_prefix_caching=enable_prefix_caching,
        speculative_config=speculative_config or {},
    )
    sched = Scheduler(config)
    ids = [f"req-{i}" for i in range(num_requests)]
    output_len = dict(zip(ids, load["output_len"], strict=True))
    modelled = dict(period=SPEC_PERIOD, acceptance=acceptance) if speculative_config else {}
    executor = FakeExecutor(
        output_len=output_len.__getitem__, check_blocks=False, block_size=BLOCK_SIZE, **modelled
    )
    timeline = _Timeline(dict(zip(ids, load["arrival_s"], strict=True)))
    slot_ctx: dict[int, int] = {}
    steps = seqs_scheduled = real_tokens = pad_tokens = 0
    order = sorted(range(num_requests), key=load["arrival_s"].__getitem__)
    now = 0.0
    nxt = 0  # index into ``order`` of the next arrival
    while nxt < num_requests or sched.has_work:
        while nxt < num_requests and load["arrival_s"][order[nxt]] <= now:
            i = order[nxt]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            prompt = _prompt(load, i)
            sched.add_request(Request(ids[i], prompt, params, arrival_time=load["arrival_s"][i]))
            nxt += 1
        step = sched.schedule(now)
        if step is None:
            events = [load["arrival_s"][order[nxt]]] if nxt < num_requests else []
            deadline = sched.next_deadline()
            if deadline is not None:
                # Just past it: the policy compares ``now - oldest >= wait`` in floats.
                events.append(max(deadline, now) + 1e-9)
            if not events:
                raise RuntimeError(f"{policy}: work is waiting but nothing can run")
            now = min(events)
            continue
        tokens, context, causal, rows = _step_shape(step.plan, slot_ctx)
        steps += 1
        seqs_scheduled += len(step.plan.scheduled)
        padding = step.plan.num_padding_tokens
        pad_tokens += padding
        real_tokens += tokens - padding
        now += cost.totals(tokens, context, causal, rows).time_s
        timeline.record(sched.update(executor.execute(step.plan)).outputs, now)

    finish = timeline.finish
    assert len(finish) == num_requests, f"{policy}: {num_requests - len(finish)} unfinished"
    total_out = sum(timeline.num_out.values())
    makespan = max(finish.values()) - min(timeline.arrival.values())
    return {
        "throughput_tok_s": total_out / makespan,
        "slot_utilization": seqs_scheduled / (max_num_seqs * steps),
        "padding_fraction": pad_tokens / (pad_tokens + real_tokens),
        **timeline.latencies(),
        "num_steps": steps,
        "preemptions": sched.num_preemptions,
        "recomputed_tokens": sched.num_recomputed_tokens,
        # Every output token but the last is computed once as a decode.
        "prefill_tokens": real_tokens - (total_out - num_requests),
        "prefix_cache_hit_rate": (
            sched.num_prefix_hits / sched.num_prefix_queries if sched.num_prefix_queries else 0.0
        ),
        "output_tokens": total_out,
        "makespan_s": makespan,
        "max_num_batched_tokens": max_num_batched_tokens,
        **(sched.spec_stats.as_dict() if sched.spec_stats is not None else {}),
    }


def simulate_speculation(
    gpu: str = "h200",
    model: str = "8b",
    tp: int | None = None,
    concurrency: tuple[int, ...] = (1, 4, 16, 64),
    num_speculative_tokens: int = 4,
    acceptance: float = 0.7,
    prompt_len: int = 512,
    output_len: int = 512,
    disable_by_batch_size: int | None = None,
) -> dict:
    """Decode speed with prompt-lookup speculation ÷ without, by how many requests
    run at once (all arriving together, each ``prompt_len`` in, ``output_len``
    out), each proposal accepted with probability ``acceptance``."""
    from ..scheduler.speculation import batch_limit_for

    cost = CostModel(gpu, model, tp)
    limit = disable_by_batch_size or batch_limit_for("cuda")
    spec = {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_min": 2, "prompt_lookup_max": 4, "disable_by_batch_size": limit}  # fmt: skip
    rows = []
    for n in concurrency:
        load = {"arrival_s": [0.0] * n, "prompt_len": [prompt_len] * n,
                "output_len": [output_len] * n}  # fmt: skip
        runs = {
            name: simulate_policy(
                "chunked",
                cost,
                load,
                max_num_seqs=max(n, 1),
                max_tokens=output_len,
                speculative_config=config,
                acceptance=acceptance,
            )  # fmt: skip
            for name, config in (("plain", None), ("ngram", spec))
        }
        plain, ngram = runs["plain"], runs["ngram"]
        rows.append({
            "concurrency": n,
            "plain_tok_s": round(plain["throughput_tok_s"], 1),
            "ngram_tok_s": round(ngram["throughput_tok_s"], 1),
            "ratio": round(ngram["throughput_tok_s"] / plain["throughput_tok_s"], 2),
            "tpot_p50_ratio": round(ngram["tpot_p50_s"] / plain["tpot_p50_s"], 2),
            "tokens_per_draft": round(ngram.get("spec_decode_num_emitted_tokens", 0)
                                      / max(1, ngram.get("spec_decode_num_drafts", 0)), 2),
        })  # fmt: skip
    return {"gpu": cost.gpu.name, "model": cost.model.name, "tp": cost.tp,
            "acceptance": acceptance, "speculative_config": spec, "rows": rows}  # fmt: skip


def simulate(
    gpu: str = "h200",
    model: str = "8b",
    tp: int | None = None,
    policies: tuple[str, ...] = POLICIES,
    num_requests: int = NUM_REQUESTS,
    request_rate: float = REQUEST_RATE,
    seed: int = 0,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | dict[str, int] | None = None,
    max_model_len: int = MAX_MODEL_LEN,
    long_fraction: float = LONG_FRACTION,
) -> dict:
    """Simulates each policy on the same seeded workload.

    ``max_num_batched_tokens``: one budget for every policy, a ``{policy: budget}``
    mapping, or None for :func:`budgets`' defaults.
    """
    cost = CostModel(gpu, model, tp)
    load = workload(num_requests, request_rate, seed, long_fraction)
    if not isinstance(max_num_batched_tokens, dict):
        max_num_batched_tokens = dict.fromkeys(policies, max_num_batched_tokens)
    results = {
        policy: simulate_policy(
            policy,
            cost,
            load,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens.get(policy),
            max_model_len=max_model_len,
        )
        for policy in policies
    }
    return {
        "gpu": cost.gpu.name,
        "model": cost.model.name,
        "tp": cost.tp,
        "num_kv_blocks": cost.num_kv_blocks(BLOCK_SIZE),
        "workload": {
            "num_requests": num_requests,
            "request_rate": None if math.isinf(request_rate) else request_rate,
            "seed": seed,
            "long_fraction": long_fraction,
            "mean_prompt_len": float(np.mean(load["prompt_len"])),
            "mean_output_len": float(np.mean(load["output_len"])),
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "max_tokens": MAX_TOKENS,
        },
        "policies": results,
    }


def run(
    gpu: str = "h200",
    model: str = "8b",
    json_path: str | Path | None = None,
    workload: str = "longtail",
    **overrides,
) -> dict:
    """The default simulation of one GPU/model pair (``overrides``: any argument
    of :func:`simulate`, or of ``prefix_sim.simulate_prefix`` for the
    ``shared-prefix`` workload); writes the result as JSON to ``json_path``."""
    if workload == "shared-prefix":
        from .prefix_sim import simulate_prefix

        result = simulate_prefix(gpu=gpu, model=model, **overrides)
    elif workload == "speculative":
        result = simulate_speculation(gpu=gpu, model=model, **overrides)
    elif workload == "fairness":
        from .fairness_sim import simulate_fairness

        result = simulate_fairness(gpu=gpu, model=model, **overrides)
    else:
        result = simulate(gpu=gpu, model=model, **overrides)
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return result
