"""Engine metrics with some activity recorded, as an engine's loop would record it."""

from __future__ import annotations

import pytest

from iterserve.cluster.metrics.engine import EngineMetrics


def record_activity(metrics: EngineMetrics) -> EngineMetrics:
    """Two requests through admission, prefill, decode and finish, a preemption, a
    rejection, a prefix cache hit and a rank restart: every family gets at least
    one sample."""
    metrics.set_state(
        num_running=2, num_waiting=3, num_preempted=1, slots_used=3, slots_total=4,
        kv_blocks_used=30, kv_blocks_total=120, kv_blocks_cached=8,
    )  # fmt: skip
    metrics.on_prefix_cache(queries=34, hits=16, evictions=1)
    for _ in range(2):
        metrics.on_prompt(17)
    metrics.observe_step(
        duration_s=0.04, forward_s=0.03, built_ahead=False, num_prefill_tokens=34,
        num_decode_tokens=0, num_padding_tokens=6, num_running=2, max_num_seqs=4,
    )  # fmt: skip
    metrics.on_first_token(queue_s=0.01, prefill_s=0.04, ttft_s=0.05)
    metrics.on_first_token(queue_s=0.02, prefill_s=0.04, ttft_s=0.06)
    metrics.observe_step(
        duration_s=0.02, forward_s=0.015, built_ahead=True, num_prefill_tokens=0,
        num_decode_tokens=2, num_padding_tokens=0, num_running=2, max_num_seqs=4,
    )  # fmt: skip
    metrics.on_tokens(3, [0.02, 0.02])
    metrics.on_tokens(1, [])
    metrics.on_preemptions(1, 18)
    metrics.on_rejected("queue_full")
    metrics.on_finish(reason="stop", e2e_s=0.11, decode_s=0.05, tpot_s=0.025)
    metrics.on_finish(reason="abort", e2e_s=0.07, decode_s=0.0, tpot_s=None)
    metrics.on_rank_restart()
    return metrics


@pytest.fixture
def busy_metrics():
    """Factory: ``busy_metrics(model_name, engine_index, policy)``."""

    def make(model_name="demo", engine_index=0, policy="chunked", *, ray_metrics=False):
        return record_activity(
            EngineMetrics(model_name, engine_index, policy, ray_metrics=ray_metrics)
        )

    return make
