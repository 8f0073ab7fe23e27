"""Prometheus metrics of one engine replica.

Every family is declared once in ``SPECS``; ``EngineMetrics`` builds it in its own
``CollectorRegistry`` (several engines may share a process in tests) and, on request,
mirrors it into ``ray.util.metrics`` so the same numbers reach Ray's metrics export.

Naming: ``iterserve_*`` in base units. ``METRIC_NAMES`` holds the *family* names as
prometheus_client declares them — the first field of every ``snapshot()`` entry:
counters without their ``_total`` suffix, histograms without ``_bucket``/``_sum``/
``_count``. A series name in a query maps back to its family by stripping exactly one
of those four suffixes; no family name ends in one of them, so the map is unambiguous.

Labels: ``model_name`` and ``engine`` (the replica index) on every series, plus the
small fixed enums below. One label's values come from requests, bounded: ``tenant``
names the few busiest tenants and calls the rest ``other`` (:mod:`.tenants`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from ...scheduler.config import POLICIES
from ...scheduler.speculation import MAX_SPECULATIVE_TOKENS
from .ray_export import RayMirror

# `_created` series double the sample count and no dashboard reads them. The switch is
# process-wide in prometheus_client; snapshot() also filters them, so the merged
# exposition stays free of them even if something re-enables the switch.
disable_created_metrics()

BASE_LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")  # FinishReason.category
REJECT_REASONS = ("queue_full",)
STEP_KINDS = ("prefill", "decode")
KV_TIERS = ("host", "disk")  # below the device (whose figures are the prefix_cache_* ones)
KV_OPS = ("store", "load")
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "num_cpu_blocks", "num_disk_blocks",
                       "enable_prefix_caching", "prefix_caching_hash_algo")  # fmt: skip

# 1 ms .. 120 s: a GPU decode step (~5-30 ms) and a CPU one (~0.1-1 s) both land
# mid-range, and the usual SLO lines (50/100/200/500 ms, 1/2/5 s) are exact bucket
# edges, so "share of requests under the SLO" needs no interpolation.
LATENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
# Token and sequence counts per step: powers of two up to the largest token budget.
COUNT_BUCKETS = tuple(float(2**i) for i in range(14))  # 1 .. 8192
# Speculative decoding: proposal positions and accepted runs, up to the most proposals a
# draft may have.
SPEC_POSITIONS = tuple(str(i) for i in range(MAX_SPECULATIVE_TOKENS))
SPEC_LENGTH_BUCKETS = tuple(i + 0.5 for i in range(MAX_SPECULATIVE_TOKENS + 1))  # le 0.5: none
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # gauge | counter | histogram
    help: str
    labels: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (label, allowed values)
    buckets: tuple[float, ...] = ()

    @property
    def label_names(self) -> tuple[str, ...]:
        return BASE_LABELS + tuple(name for name, _ in self.labels)


def _gauge(name, help, labels=()):
    return MetricSpec(name, "gauge", help, labels)


def _counter(name, help, labels=()):
    return MetricSpec(name, "counter", help, labels)


def _histogram(name, help, buckets, labels=()):
    return MetricSpec(name, "histogram", help, labels, buckets)


SPECS: tuple[MetricSpec, ...] = (
    _gauge("iterserve_requests_running", "Requests holding a slot and computing."),
    _gauge("iterserve_requests_waiting", "Requests queued for a slot, preempted ones included."),
    _gauge("iterserve_requests_preempted", "Queued requests whose KV was dropped, awaiting recompute."),
    _gauge("iterserve_slots_used", "Slots held, by running sequences or by static batching's finished ones."),
    _gauge("iterserve_slots_capacity", "Slots of the engine (max_num_seqs)."),
    _gauge("iterserve_kv_blocks_used", "KV cache blocks allocated to sequences."),
    _gauge("iterserve_kv_blocks_capacity", "KV cache blocks of the engine."),
    _gauge("iterserve_kv_cache_usage_ratio", "KV cache blocks used / capacity (0..1)."),
    _gauge("iterserve_kv_blocks_cached", "KV cache blocks holding a cached prefix block, in use or kept until evicted."),
    _gauge("iterserve_policy_info", "The engine's batching policy; value is always 1.",
           (("policy", POLICIES),)),
    _counter("iterserve_prompt_tokens", "Prompt tokens of admitted requests."),
    _counter("iterserve_generation_tokens", "Tokens generated, the first token included."),
    _counter("iterserve_padding_tokens", "Padding tokens computed: padded prefill positions and finished slots a static batch keeps computing."),
    _counter("iterserve_preemptions", "Running sequences preempted (KV freed, recomputed later)."),
    _counter("iterserve_recomputed_tokens", "Tokens a preempted sequence computes again as it resumes: those it had computed, less those still cached."),
    _counter("iterserve_requests_finished", "Requests finished, by reason.", (("reason", FINISH_REASONS),)),
    _counter("iterserve_requests_rejected", "Requests refused at admission, by reason.", (("reason", REJECT_REASONS),)),
    _counter("iterserve_rank_restarts", "Rank group restarts after a rank failure."),
    _counter("iterserve_prefix_cache_queries", "Tokens of admitted sequences looked up in the prefix cache."),
    _counter("iterserve_prefix_cache_hits", "Of the tokens looked up, those found cached: their KV is not computed again."),
    _counter("iterserve_prefix_cache_evictions", "Cached blocks evicted to give a sequence a fresh block."),
    _histogram("iterserve_time_to_first_token_seconds", "Arrival to first generated token.", LATENCY_BUCKETS),
    _histogram("iterserve_inter_token_latency_seconds", "Time between consecutive tokens of one request.", LATENCY_BUCKETS),
    _histogram("iterserve_time_per_output_token_seconds", "Decode time / (output tokens - 1), per request.", LATENCY_BUCKETS),
    _histogram("iterserve_e2e_request_latency_seconds", "Arrival to finish, per request.", LATENCY_BUCKETS),
    _histogram("iterserve_request_queue_time_seconds", "Arrival to first scheduled step, per request.", LATENCY_BUCKETS),
    _histogram("iterserve_request_prefill_time_seconds", "First scheduled step to first token, per request.", LATENCY_BUCKETS),
    _histogram("iterserve_request_decode_time_seconds", "First token to finish, per request.", LATENCY_BUCKETS),
    _histogram("iterserve_step_duration_seconds", "Wall time of one engine iteration.", LATENCY_BUCKETS),
    _histogram("iterserve_step_forward_seconds", "The ranks' own model time in one iteration.", LATENCY_BUCKETS),
    _counter("iterserve_steps_built_ahead", "Steps whose plan was built while the step before them ran."),
    _histogram("iterserve_step_tokens", "Useful tokens computed per step, by kind (padding excluded).", COUNT_BUCKETS,
               (("kind", STEP_KINDS),)),
    _histogram("iterserve_step_running_sequences", "Live sequences computing in one step.", COUNT_BUCKETS),
    _histogram("iterserve_step_slot_utilization_ratio", "Live sequences / slots, per step (0..1).", RATIO_BUCKETS),
    # LoRA adapters: the adapter label's values are the names an operator loaded.
    _gauge("iterserve_lora_requests_running", "Requests running on each loaded LoRA adapter.",
           (("adapter", ()),)),
    _gauge("iterserve_lora_requests_waiting", "Requests waiting for each loaded LoRA adapter.",
           (("adapter", ()),)),
    _gauge("iterserve_lora_adapters_resident", "LoRA adapters the ranks hold now (at most max_loras)."),
    _counter("iterserve_lora_loads", "LoRA adapters loaded into a rank slot."),
    _counter("iterserve_lora_evictions", "LoRA adapters that left a rank slot (least recently used, or unloaded)."),
    # Speculative decoding, named after vLLM's spec_decode_* series: a draft is one
    # sequence's proposals in one step.
    _counter("iterserve_spec_decode_num_drafts", "Drafts verified: one sequence's proposals in one step."),
    _counter("iterserve_spec_decode_num_draft_tokens", "Proposed tokens verified."),
    _counter("iterserve_spec_decode_num_accepted_tokens", "Proposed tokens accepted (equal to what the model sampled)."),
    _counter("iterserve_spec_decode_num_emitted_tokens", "Tokens drafts produced: accepted ones plus the one sampled after each run."),
    _counter("iterserve_spec_decode_num_accepted_tokens_per_pos", "Drafts whose proposal at each position was accepted.",
             (("position", SPEC_POSITIONS),)),
    _histogram("iterserve_spec_decode_acceptance_length", "Proposals accepted per draft (le 0.5: none).", SPEC_LENGTH_BUCKETS),
    # Tenants (a request's gateway fairness id or user): the busiest by name, the rest
    # as "other" (cluster/metrics/tenants.py keeps the label set bounded).
    _gauge("iterserve_tenant_requests_waiting", "Requests waiting, by tenant.", (("tenant", ()),)),
    _gauge("iterserve_tenant_requests_running", "Requests running, by tenant.", (("tenant", ()),)),
    _counter("iterserve_tenant_served_tokens", "Tokens computed for each tenant's requests: prompt tokens not found cached, and generated ones.",
             (("tenant", ()),)),
    _histogram("iterserve_tenant_time_to_first_token_seconds", "Arrival to first generated token, by tenant.", LATENCY_BUCKETS,
               (("tenant", ()),)),
    # The KV tiers below the device: host memory and disk (docs/serving.md, KV cache tiers).
    _gauge("iterserve_cache_config_info", "The KV cache's configuration (block size, blocks per tier, the block hash); value is always 1.",
           tuple((name, ()) for name in CACHE_CONFIG_LABELS)),
    _counter("iterserve_kv_tier_queries", "Prompt tokens looked up in a tier below the device (not found above it).",
             (("tier", KV_TIERS),)),
    _counter("iterserve_kv_tier_hits", "Of those, tokens found in the tier and reused instead of computed.",
             (("tier", KV_TIERS),)),
    _counter("iterserve_kv_tier_bytes", "Bytes moved into a tier (store) or out of it towards the device (load).",
             (("tier", KV_TIERS), ("op", KV_OPS))),
    _histogram("iterserve_kv_tier_transfer_seconds", "Time of a tier's transfers: a step's host copies, one disk file's read or write.",
               LATENCY_BUCKETS, (("tier", KV_TIERS), ("op", KV_OPS))),
    _counter("iterserve_kv_disk_reads_failed", "Disk reads that found no valid file (gone, corrupt, foreign): their tokens are computed again."),
    _counter("iterserve_kv_disk_writes_dropped", "Disk writes dropped because the disk did not keep up (or refused them)."),
    _counter("iterserve_tenant_ttft_slo_missed", "Requests whose first token came after their first-token target (x-slo-ttft-ms, or their tenant's), by tenant.",
             (("tenant", ()),)),
)  # fmt: skip
# Families whose label values are not a fixed enum: their series are made and
# dropped as the label values come and go (set_lora).
TENANT_FAMILIES = (
    "iterserve_tenant_requests_waiting", "iterserve_tenant_requests_running",
    "iterserve_tenant_served_tokens", "iterserve_tenant_time_to_first_token_seconds",
    "iterserve_tenant_ttft_slo_missed",
)  # fmt: skip
DYNAMIC_LABELS = (
    "iterserve_lora_requests_running", "iterserve_lora_requests_waiting", *TENANT_FAMILIES,
    "iterserve_cache_config_info",
)  # fmt: skip

METRIC_NAMES: frozenset[str] = frozenset(spec.name for spec in SPECS)
_TYPES = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}


class EngineMetrics:
    """The metrics of one engine replica; every method is cheap enough for each step."""

    def __init__(
        self, model_name: str, engine_index: int, policy: str, *, ray_metrics: bool = False
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.model_name = model_name
        self.engine = str(engine_index)
        self.policy = policy
        self.registry = CollectorRegistry()
        base = (model_name, self.engine)
        # Children are bound once for every allowed label combination: recording is one
        # dict lookup, and counters of every reason exist at 0 from the start, so
        # rate() over them returns 0 rather than nothing.
        self._children: dict[tuple, object] = {}
        self._families: dict[str, object] = {}
        self._adapters: set[str] = set()  # the adapter label values with series now
        self._tenant_labels: dict[str, set[str]] = {}  # family -> tenant labels with series
        # Running totals of every counter and histogram, recorded with them: what
        # ``totals()`` (the engine's stats) reads, so stats and metrics never disagree.
        self._totals: dict[tuple, float] = {}
        for spec in SPECS:
            kwargs = {"buckets": spec.buckets} if spec.kind == "histogram" else {}
            family = _TYPES[spec.kind](
                spec.name, spec.help, spec.label_names, registry=self.registry, **kwargs
            )
            self._families[spec.name] = family
            values = [allowed for _, allowed in spec.labels]
            if spec.name in DYNAMIC_LABELS:
                continue
            if spec.name == "iterserve_policy_info":
                values = [(policy,)]  # an info gauge carries only the active value
            for extra in product(*values):
                self._children[spec.name, extra] = family.labels(*base, *extra)
        self._children["iterserve_policy_info", (policy,)].set(1)
        self._ray = RayMirror(model_name, self.engine) if ray_metrics else None
        if self._ray is not None:
            self._ray.record("set", "iterserve_policy_info", 1, (policy,))

    # -- recording -------------------------------------------------------------------

    def set_state(
        self, *, num_running, num_waiting, num_preempted, slots_used, slots_total,
        kv_blocks_used, kv_blocks_total, kv_blocks_cached=0,
    ) -> None:  # fmt: skip
        self._set("iterserve_requests_running", num_running)
        self._set("iterserve_requests_waiting", num_waiting)
        self._set("iterserve_requests_preempted", num_preempted)
        self._set("iterserve_slots_used", slots_used)
        self._set("iterserve_slots_capacity", slots_total)
        self._set("iterserve_kv_blocks_used", kv_blocks_used)
        self._set("iterserve_kv_blocks_capacity", kv_blocks_total)
        usage = kv_blocks_used / kv_blocks_total if kv_blocks_total else 0.0
        self._set("iterserve_kv_cache_usage_ratio", usage)
        self._set("iterserve_kv_blocks_cached", kv_blocks_cached)

    def observe_step(
        self, *, duration_s, forward_s, built_ahead, num_prefill_tokens, num_decode_tokens,
        num_padding_tokens, num_running, max_num_seqs,
    ) -> None:  # fmt: skip
        """One iteration. Prefill/decode counts are useful tokens only; padding is
        counted apart. ``num_running`` counts live sequences, not the finished slots a
        static batch still pads, so slot utilization shows static batching's waste."""
        self._observe("iterserve_step_duration_seconds", duration_s)
        self._observe("iterserve_step_forward_seconds", forward_s)
        self._inc("iterserve_steps_built_ahead", int(built_ahead))
        # Both kinds every step: per kind, _count is the step count and _sum/_count the
        # average tokens of that kind per step, so the two stack into the step's load.
        self._observe("iterserve_step_tokens", num_prefill_tokens, ("prefill",))
        self._observe("iterserve_step_tokens", num_decode_tokens, ("decode",))
        self._inc("iterserve_padding_tokens", num_padding_tokens)
        self._observe("iterserve_step_running_sequences", num_running)
        utilization = min(num_running / max_num_seqs, 1.0) if max_num_seqs else 0.0
        self._observe("iterserve_step_slot_utilization_ratio", utilization)

    def on_prompt(self, num_tokens: int) -> None:
        self._inc("iterserve_prompt_tokens", num_tokens)

    def on_rejected(self, reason: str) -> None:
        self._inc("iterserve_requests_rejected", 1, (_checked(reason, REJECT_REASONS),))

    def on_first_token(self, *, queue_s: float, prefill_s: float, ttft_s: float) -> None:
        self._observe("iterserve_request_queue_time_seconds", queue_s)
        self._observe("iterserve_request_prefill_time_seconds", prefill_s)
        self._observe("iterserve_time_to_first_token_seconds", ttft_s)

    def on_tokens(self, num_tokens: int, itl_s: list[float]) -> None:
        """``num_tokens`` generated tokens (the first included); one ITL per later token."""
        self._inc("iterserve_generation_tokens", num_tokens)
        for gap in itl_s:
            self._observe("iterserve_inter_token_latency_seconds", gap)

    def on_finish(
        self, *, reason: str, e2e_s: float, decode_s: float, tpot_s: float | None
    ) -> None:
        """``reason``: stop | length | abort | error (``FinishReason.category``);
        ``tpot_s`` is None for a request with fewer than two output tokens."""
        self._inc("iterserve_requests_finished", 1, (_checked(reason, FINISH_REASONS),))
        self._observe("iterserve_e2e_request_latency_seconds", e2e_s)
        self._observe("iterserve_request_decode_time_seconds", decode_s)
        if tpot_s is not None:
            self._observe("iterserve_time_per_output_token_seconds", tpot_s)

    def on_preemptions(self, n: int, recomputed_tokens: int) -> None:
        self._inc("iterserve_preemptions", n)
        self._inc("iterserve_recomputed_tokens", recomputed_tokens)

    def set_lora(self, *, resident: int, loads: int, evictions: int,
                 running: dict[str, int], waiting: dict[str, int]) -> None:  # fmt: skip
        """LoRA adapters now: resident, new loads and evictions since the last call,
        and requests running and waiting per loaded adapter (``running`` names every
        loaded one; an unloaded adapter's series go)."""
        self._set("iterserve_lora_adapters_resident", resident)
        self._inc("iterserve_lora_loads", loads)
        self._inc("iterserve_lora_evictions", evictions)
        base = (self.model_name, self.engine)
        names = set(running)
        for name in ("iterserve_lora_requests_running", "iterserve_lora_requests_waiting"):
            family = self._families[name]
            for gone in self._adapters - names:
                family.remove(*base, gone)  # type: ignore[attr-defined]
            counts = running if name.endswith("running") else waiting
            for adapter in names:
                family.labels(*base, adapter).set(counts.get(adapter, 0))  # type: ignore[attr-defined]
        self._adapters = names

    def on_speculation(self, *, drafts: int, draft_tokens: int, accepted: int, emitted: int,
                       accepted_per_pos: list[int], lengths: list[int]) -> None:  # fmt: skip
        """Drafts verified since the last call: their proposed, accepted and emitted
        tokens, acceptances by position, and how many drafts kept each run length
        (``lengths[a]``: drafts with ``a`` proposals accepted)."""
        self._inc("iterserve_spec_decode_num_drafts", drafts)
        self._inc("iterserve_spec_decode_num_draft_tokens", draft_tokens)
        self._inc("iterserve_spec_decode_num_accepted_tokens", accepted)
        self._inc("iterserve_spec_decode_num_emitted_tokens", emitted)
        for pos, n in enumerate(accepted_per_pos):
            if n:
                self._inc("iterserve_spec_decode_num_accepted_tokens_per_pos", n, (str(pos),))
        for length, n in enumerate(lengths):
            for _ in range(n):
                self._observe("iterserve_spec_decode_acceptance_length", length)

    def set_tenants(self, waiting: dict[str, int], running: dict[str, int]) -> None:
        """Requests waiting and running per tenant label. A label keeps its series,
        at 0 while it has nothing waiting or running, until :meth:`drop_tenant`: a
        panel reads 0 then, not "no data"."""
        labels = set(waiting) | set(running)
        for name, counts in (("iterserve_tenant_requests_waiting", waiting),
                             ("iterserve_tenant_requests_running", running)):  # fmt: skip
            for label in labels | self._tenant_labels.get(name, set()):
                self._dynamic(name, label).set(counts.get(label, 0))  # type: ignore[attr-defined]

    def on_tenant_tokens(self, label: str, num_tokens: int) -> None:
        if num_tokens > 0:
            self._dynamic("iterserve_tenant_served_tokens", label).inc(num_tokens)  # type: ignore[attr-defined]

    def on_tenant_first_token(self, label: str, ttft_s: float, missed: bool) -> None:
        self._dynamic("iterserve_tenant_time_to_first_token_seconds", label).observe(
            max(ttft_s, 0.0)
        )  # type: ignore[attr-defined]
        # the series exists (at 0) from a tenant's first token on, so a rate of misses
        # reads 0 rather than no data
        missed_total = self._dynamic("iterserve_tenant_ttft_slo_missed", label)
        if missed:
            missed_total.inc()  # type: ignore[attr-defined]

    def drop_tenant(self, label: str) -> None:
        """Drops a tenant label's series (no longer among the named ones: its
        requests and tokens count as ``other`` from now on)."""
        for name in TENANT_FAMILIES:
            self._drop(name, label)

    def _dynamic(self, name: str, label: str):
        self._tenant_labels.setdefault(name, set()).add(label)
        return self._families[name].labels(self.model_name, self.engine, label)  # type: ignore[attr-defined]

    def _drop(self, name: str, label: str) -> None:
        labels = self._tenant_labels.get(name, set())
        if label in labels:
            labels.discard(label)
            self._families[name].remove(self.model_name, self.engine, label)  # type: ignore[attr-defined]

    def set_cache_config(self, **labels: str) -> None:
        """The KV cache's configuration, as one info series (``CACHE_CONFIG_LABELS``)."""
        values = [str(labels[name]) for name in CACHE_CONFIG_LABELS]
        self._families["iterserve_cache_config_info"].labels(  # type: ignore[attr-defined]
            self.model_name, self.engine, *values
        ).set(1)

    def on_kv_tiers(self, delta: dict[str, int], block_bytes: int) -> None:
        """What the tiers did since the last call (``KVTiers.counts`` differences)."""
        for tier in KV_TIERS:
            self._inc("iterserve_kv_tier_queries", delta[f"{tier}_queries"], (tier,))
            self._inc("iterserve_kv_tier_hits", delta[f"{tier}_hits"], (tier,))
        for tier, op, count in (("host", "store", "stores"), ("host", "load", "loads"),
                                ("disk", "store", "writes"), ("disk", "load", "reads")):  # fmt: skip
            self._inc("iterserve_kv_tier_bytes", delta[count] * block_bytes, (tier, op))
        self._inc("iterserve_kv_disk_reads_failed", delta["reads_failed"])
        self._inc("iterserve_kv_disk_writes_dropped", delta["writes_dropped"])

    def on_kv_latency(self, copy_s: float, read_s: list[float], write_s: list[float]) -> None:
        if copy_s:
            self._observe("iterserve_kv_tier_transfer_seconds", copy_s, ("host", "store"))
        for seconds in read_s:
            self._observe("iterserve_kv_tier_transfer_seconds", seconds, ("disk", "load"))
        for seconds in write_s:
            self._observe("iterserve_kv_tier_transfer_seconds", seconds, ("disk", "store"))

    def on_rank_restart(self) -> None:
        self._inc("iterserve_rank_restarts", 1)

    def on_prefix_cache(self, *, queries: int, hits: int, evictions: int) -> None:
        """Tokens looked up at admission and found cached, cached blocks evicted."""
        self._inc("iterserve_prefix_cache_queries", queries)
        self._inc("iterserve_prefix_cache_hits", hits)
        self._inc("iterserve_prefix_cache_evictions", evictions)

    # -- export ----------------------------------------------------------------------

    def totals(self) -> dict:
        """The engine's totals for ``stats()``: ``counters`` and ``timing`` (wall time
        of whole steps against the ranks' forward time: the difference is the
        control plane's cost that the steps do not hide)."""
        t = self._totals.get
        counters = {
            "prompt_tokens": t(("iterserve_prompt_tokens", ()), 0),
            "generation_tokens": t(("iterserve_generation_tokens", ()), 0),
            "padding_tokens": t(("iterserve_padding_tokens", ()), 0),
            "prefix_cache_queries": t(("iterserve_prefix_cache_queries", ()), 0),
            "prefix_cache_hits": t(("iterserve_prefix_cache_hits", ()), 0),
            "prefix_cache_evictions": t(("iterserve_prefix_cache_evictions", ()), 0),
            "spec_decode_num_drafts": t(("iterserve_spec_decode_num_drafts", ()), 0),
            "spec_decode_num_draft_tokens": t(("iterserve_spec_decode_num_draft_tokens", ()), 0),
            "spec_decode_num_accepted_tokens": t(
                ("iterserve_spec_decode_num_accepted_tokens", ()), 0
            ),
        }
        for reason in FINISH_REASONS:
            counters[f"finished_{reason}"] = t(("iterserve_requests_finished", (reason,)), 0)
        for reason in REJECT_REASONS:
            counters[f"rejected_{reason}"] = t(("iterserve_requests_rejected", (reason,)), 0)
        timing = {
            "steps": t(("iterserve_step_duration_seconds", (), "count"), 0),
            "step_s": t(("iterserve_step_duration_seconds", (), "sum"), 0.0),
            "forward_s": t(("iterserve_step_forward_seconds", (), "sum"), 0.0),
            "steps_ahead": t(("iterserve_steps_built_ahead", ()), 0),
        }
        return {"counters": counters, "timing": timing}

    def snapshot(self) -> list:
        """Every family as ``(name, type, help, [(sample_name, labels, value), ...])``:
        plain data that msgpack, pickle and Ray carry as is (see metrics_hub.render)."""
        out = []
        for family in self.registry.collect():
            samples = [
                (s.name, dict(s.labels), float(s.value))
                for s in family.samples
                if not s.name.endswith("_created")
            ]
            out.append((family.name, family.type, family.documentation, samples))
        return out

    def exposition(self) -> bytes:
        """Prometheus text format of this engine alone."""
        return generate_latest(self.registry)

    # -- internals -------------------------------------------------------------------

    def _set(self, name: str, value: float, extra: tuple = ()) -> None:
        self._children[name, extra].set(value)
        if self._ray is not None:
            self._ray.record("set", name, value, extra)

    def _inc(self, name: str, value: float, extra: tuple = ()) -> None:
        if value <= 0:  # counters only go up; a zero increment is a no-op anyway
            return
        self._children[name, extra].inc(value)
        self._totals[name, extra] = self._totals.get((name, extra), 0) + value
        if self._ray is not None:
            self._ray.record("inc", name, value, extra)

    def _observe(self, name: str, value: float, extra: tuple = ()) -> None:
        value = max(float(value), 0.0)  # a clock stepping back must not make sums shrink
        self._children[name, extra].observe(value)
        totals = self._totals
        totals[name, extra, "sum"] = totals.get((name, extra, "sum"), 0.0) + value
        totals[name, extra, "count"] = totals.get((name, extra, "count"), 0) + 1
        if self._ray is not None:
            self._ray.record("observe", name, value, extra)


def _checked(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"expected one of {', '.join(allowed)}, got {value!r}")
    return value
