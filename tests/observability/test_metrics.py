"""EngineMetrics: names, labels, buckets, and what each recording call changes."""

from __future__ import annotations

import re

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iterserve.cluster.metrics.engine import (
    COUNT_BUCKETS,
    FINISH_REASONS,
    KV_OPS,
    KV_TIERS,
    LATENCY_BUCKETS,
    METRIC_NAMES,
    RATIO_BUCKETS,
    REJECT_REASONS,
    SPEC_POSITIONS,
    SPECS,
    STEP_KINDS,
    EngineMetrics,
)
from iterserve.scheduler import FinishReason
from iterserve.scheduler.config import POLICIES
from tests.observability.prom import SERIES_SUFFIXES

ALLOWED_LABELS = {
    "reason": set(FINISH_REASONS) | set(REJECT_REASONS),
    "kind": set(STEP_KINDS),
    "policy": set(POLICIES),
    "position": set(SPEC_POSITIONS),
    "tier": set(KV_TIERS),
    "op": set(KV_OPS),
}
SLO_BOUNDARIES_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def sample(metrics: EngineMetrics, sample_name: str, **labels) -> float:
    """The value of one sample in the snapshot (labels other than the base ones given)."""
    for _, _, _, samples in metrics.snapshot():
        for name, sample_labels, value in samples:
            extra = {k: v for k, v in sample_labels.items() if k not in ("model_name", "engine")}
            if name == sample_name and extra == labels:
                return value
    raise KeyError((sample_name, labels))


def test_family_names_follow_prometheus_conventions():
    for spec in SPECS:
        assert re.fullmatch(r"iterserve_[a-z0-9]+(_[a-z0-9]+)*", spec.name), spec.name
        # The suffix-stripping map from series to family must be unambiguous.
        assert not spec.name.endswith(SERIES_SUFFIXES), spec.name
        if spec.buckets == LATENCY_BUCKETS:
            assert spec.name.endswith("_seconds"), spec.name
        if spec.buckets == RATIO_BUCKETS or "ratio" in spec.name.split("_"):
            assert spec.name.endswith("_ratio"), spec.name
    assert len(METRIC_NAMES) == len(SPECS)


def test_snapshot_covers_exactly_the_declared_families():
    snapshot = EngineMetrics("demo", 0, "static").snapshot()
    assert {family[0] for family in snapshot} == METRIC_NAMES
    types = {family[0]: family[1] for family in snapshot}
    assert {spec.name: spec.kind for spec in SPECS} == types


def test_every_series_carries_model_and_engine_and_only_allowed_labels(busy_metrics):
    text = busy_metrics("demo", 3, "continuous").exposition().decode()
    assert "_created" not in text
    num_samples = 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            num_samples += 1
            assert s.labels["model_name"] == "demo" and s.labels["engine"] == "3", s
            extra = set(s.labels) - {"model_name", "engine", "le"}
            assert extra <= set(ALLOWED_LABELS), s
            for label in extra:
                assert s.labels[label] in ALLOWED_LABELS[label], s
            if "le" in s.labels:
                assert s.name.endswith("_bucket"), s
    assert num_samples > 100


def test_counter_series_end_in_total_in_the_exposition(busy_metrics):
    text = busy_metrics().exposition().decode()
    counters = re.findall(r"^# TYPE (\S+) counter$", text, re.M)
    assert counters and all(name.endswith("_total") for name in counters)


def test_buckets_hold_the_slo_boundaries_and_fit_cpu_and_gpu():
    assert set(SLO_BOUNDARIES_S) <= set(LATENCY_BUCKETS)
    assert LATENCY_BUCKETS[0] == 0.001 and LATENCY_BUCKETS[-1] >= 120
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS))
    assert COUNT_BUCKETS == tuple(float(2**i) for i in range(14))
    assert RATIO_BUCKETS[-1] == 1.0 and all(0 < b <= 1 for b in RATIO_BUCKETS)
    # ... and they reach the exposition: the TTFT histogram has an edge at each SLO.
    snapshot = EngineMetrics("demo", 0, "chunked").snapshot()
    ttft = next(f for f in snapshot if f[0] == "iterserve_time_to_first_token_seconds")
    edges = {labels["le"] for name, labels, _ in ttft[3] if name.endswith("_bucket")}
    assert {str(b) for b in SLO_BOUNDARIES_S} | {"+Inf"} <= edges


def test_enum_counters_exist_at_zero_before_any_event():
    metrics = EngineMetrics("demo", 0, "chunked")
    for reason in FINISH_REASONS:
        assert sample(metrics, "iterserve_requests_finished_total", reason=reason) == 0
    assert sample(metrics, "iterserve_requests_rejected_total", reason="queue_full") == 0
    assert sample(metrics, "iterserve_policy_info", policy="chunked") == 1
    for kind in STEP_KINDS:
        assert sample(metrics, "iterserve_step_tokens_count", kind=kind) == 0


def test_request_events_move_their_series():
    metrics = EngineMetrics("demo", 0, "continuous")
    metrics.on_prompt(12)
    metrics.on_first_token(queue_s=0.01, prefill_s=0.03, ttft_s=0.04)
    metrics.on_tokens(3, [0.02, 0.03])
    metrics.on_finish(reason="length", e2e_s=0.2, decode_s=0.16, tpot_s=0.08)
    assert sample(metrics, "iterserve_prompt_tokens_total") == 12
    assert sample(metrics, "iterserve_time_to_first_token_seconds_count") == 1
    assert sample(metrics, "iterserve_time_to_first_token_seconds_sum") == pytest.approx(0.04)
    assert sample(metrics, "iterserve_time_to_first_token_seconds_bucket", le="0.05") == 1
    assert sample(metrics, "iterserve_time_to_first_token_seconds_bucket", le="0.03") == 0
    assert sample(metrics, "iterserve_request_queue_time_seconds_count") == 1
    assert sample(metrics, "iterserve_request_prefill_time_seconds_count") == 1
    assert sample(metrics, "iterserve_generation_tokens_total") == 3
    assert sample(metrics, "iterserve_inter_token_latency_seconds_count") == 2
    assert sample(metrics, "iterserve_requests_finished_total", reason="length") == 1
    assert sample(metrics, "iterserve_requests_finished_total", reason="stop") == 0
    assert sample(metrics, "iterserve_e2e_request_latency_seconds_count") == 1
    assert sample(metrics, "iterserve_request_decode_time_seconds_count") == 1
    assert sample(metrics, "iterserve_time_per_output_token_seconds_count") == 1


def test_finish_reasons_fold_the_schedulers_own_into_stop():
    metrics = EngineMetrics("demo", 0, "chunked")
    for reason in (FinishReason.EOS, FinishReason.STOP_TOKEN, FinishReason.ERROR):
        metrics.on_finish(reason=reason.category, e2e_s=0.1, decode_s=0.0, tpot_s=None)
    assert sample(metrics, "iterserve_requests_finished_total", reason="stop") == 2
    assert sample(metrics, "iterserve_requests_finished_total", reason="error") == 1
    # A request with a single output token has no TPOT.
    assert sample(metrics, "iterserve_time_per_output_token_seconds_count") == 0


def test_step_and_state_series():
    metrics = EngineMetrics("demo", 1, "static")
    metrics.observe_step(
        duration_s=0.5, forward_s=0.4, built_ahead=True, num_prefill_tokens=0,
        num_decode_tokens=3, num_padding_tokens=5, num_running=3, max_num_seqs=8,
    )  # fmt: skip
    metrics.set_state(
        num_running=3, num_waiting=4, num_preempted=0, slots_used=8, slots_total=8,
        kv_blocks_used=25, kv_blocks_total=100,
    )  # fmt: skip
    assert sample(metrics, "iterserve_step_duration_seconds_count") == 1
    assert sample(metrics, "iterserve_step_tokens_sum", kind="decode") == 3
    assert sample(metrics, "iterserve_step_tokens_count", kind="prefill") == 1
    assert sample(metrics, "iterserve_padding_tokens_total") == 5
    assert sample(metrics, "iterserve_step_running_sequences_sum") == 3
    assert sample(metrics, "iterserve_step_slot_utilization_ratio_sum") == pytest.approx(3 / 8)
    assert sample(metrics, "iterserve_slots_used") == 8
    assert sample(metrics, "iterserve_requests_waiting") == 4
    assert sample(metrics, "iterserve_kv_cache_usage_ratio") == pytest.approx(0.25)


def test_failure_events():
    metrics = EngineMetrics("demo", 0, "chunked")
    metrics.on_preemptions(2, 40)
    metrics.on_preemptions(0, 0)  # a step without preemptions records nothing
    metrics.on_rejected("queue_full")
    metrics.on_rank_restart()
    assert sample(metrics, "iterserve_preemptions_total") == 2
    assert sample(metrics, "iterserve_recomputed_tokens_total") == 40
    assert sample(metrics, "iterserve_requests_rejected_total", reason="queue_full") == 1
    assert sample(metrics, "iterserve_rank_restarts_total") == 1


def test_prefix_cache_series():
    metrics = EngineMetrics("demo", 0, "chunked")
    metrics.on_prefix_cache(queries=40, hits=32, evictions=0)
    metrics.on_prefix_cache(queries=10, hits=0, evictions=3)
    metrics.set_state(
        num_running=1, num_waiting=0, num_preempted=0, slots_used=1, slots_total=8,
        kv_blocks_used=4, kv_blocks_total=100, kv_blocks_cached=12,
    )  # fmt: skip
    assert sample(metrics, "iterserve_prefix_cache_queries_total") == 50
    assert sample(metrics, "iterserve_prefix_cache_hits_total") == 32
    assert sample(metrics, "iterserve_prefix_cache_evictions_total") == 3
    assert sample(metrics, "iterserve_kv_blocks_cached") == 12
    counters = metrics.totals()["counters"]
    assert (counters["prefix_cache_queries"], counters["prefix_cache_hits"]) == (50, 32)


def test_label_values_outside_the_enums_are_refused():
    metrics = EngineMetrics("demo", 0, "chunked")
    with pytest.raises(ValueError):
        metrics.on_finish(reason="user-supplied", e2e_s=1.0, decode_s=1.0, tpot_s=None)
    with pytest.raises(ValueError):
        metrics.on_rejected("too_long")
    with pytest.raises(ValueError):
        EngineMetrics("demo", 0, "greedy")


def test_engines_in_one_process_keep_separate_registries():
    a, b = EngineMetrics("demo", 0, "chunked"), EngineMetrics("demo", 1, "static")
    a.on_prompt(5)
    assert sample(a, "iterserve_prompt_tokens_total") == 5
    assert sample(b, "iterserve_prompt_tokens_total") == 0
    assert a.registry is not b.registry


def test_snapshot_is_plain_data_that_survives_msgpack(busy_metrics):
    snapshot = busy_metrics().snapshot()
    decoded = msgpack.unpackb(msgpack.packb(snapshot), strict_map_key=True)
    assert [list(f[:3]) for f in snapshot] == [f[:3] for f in decoded]
    assert [[list(s) for s in f[3]] for f in snapshot] == [f[3] for f in decoded]


def test_ray_mirror_declares_the_same_families(ray_session, busy_metrics):
    # Every recording path runs through the Ray metrics too.
    metrics = busy_metrics("demo", 0, "chunked", ray_metrics=True)
    mirrored = metrics._ray._metrics
    assert set(mirrored) == METRIC_NAMES
    for spec in SPECS:
        info = mirrored[spec.name][0].info
        assert info["name"] == spec.name
        assert tuple(info["tag_keys"]) == spec.label_names
        assert info["default_tags"] == {"model_name": "demo", "engine": "0"}
    # Recorded off the caller's thread: everything queued reaches Ray, nothing dropped.
    metrics._ray.flush()
    assert metrics._ray._pending.empty() and metrics._ray.dropped == 0


def test_speculation_series_follow_the_schedulers_counts():
    """A scheduler speculating over outputs that repeat: the recorder turns its
    counts into vLLM-style spec_decode series, each step's delta once."""
    from iterserve.cluster.metrics.recorder import MetricsRecorder
    from iterserve.scheduler import FakeExecutor, Request, SamplingParams, Scheduler
    from iterserve.scheduler.config import SchedulerConfig

    config = SchedulerConfig(
        policy="chunked", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
        block_size=4, num_kv_blocks=200,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    )  # fmt: skip
    sched = Scheduler(config, ahead=False)
    executor = FakeExecutor(vocab_size=64, block_size=4, period=4)
    metrics = EngineMetrics("demo", 0, "chunked")
    recorder = MetricsRecorder(metrics)
    for i in range(3):
        sched.add_request(Request(f"r{i}", [5, 6, 7, 8 + i], SamplingParams(max_tokens=40)))
    while sched.has_work:
        step = sched.schedule(0.0)
        result = executor.execute(step.plan)
        recorder.outputs(sched.update(result).outputs)
        recorder.step(step, result, 0.01, sched)
    stats = sched.spec_stats
    assert stats.num_accepted_tokens > 0
    assert sample(metrics, "iterserve_spec_decode_num_drafts_total") == stats.num_drafts
    assert sample(metrics, "iterserve_spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert sample(metrics, "iterserve_spec_decode_num_accepted_tokens_total") == (
        stats.num_accepted_tokens
    )
    assert sample(metrics, "iterserve_spec_decode_num_emitted_tokens_total") == (
        stats.num_emitted_tokens
    )
    for pos in range(3):
        got = sample(metrics, "iterserve_spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(pos))  # fmt: skip
        assert got == stats.accepted_per_pos[pos]
    assert sample(metrics, "iterserve_spec_decode_acceptance_length_count") == stats.num_drafts
    assert sample(metrics, "iterserve_generation_tokens_total") == 120
