"""The engine autoscaling policy: more replicas when requests wait, the KV cache
fills or first tokens are slow; fewer, down to the minimum, when idle; nothing
before any replica reported; always within the bounds. (Serve's context, faked.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from iterserve.cluster.serve.app import ServeArgs
from iterserve.cluster.serve.autoscaling import AutoscalingArgs, EngineAutoscalingPolicy


def ctx(replicas: int, per_replica: dict[str, list[float]], low: int = 1, high: int = 4):
    metrics = {
        name: {f"r{i}": v for i, v in enumerate(values)} for name, values in per_replica.items()
    }
    return SimpleNamespace(
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        aggregated_metrics=metrics,
        capacity_adjusted_min_replicas=low,
        capacity_adjusted_max_replicas=high,
    )


def load(waiting, running, kv, ttft):
    return {"num_waiting": waiting, "num_running": running, "kv_usage": kv, "ttft_s": ttft}


POLICY = EngineAutoscalingPolicy(target_ongoing_requests=8, target_kv_usage=0.9, target_ttft_s=2.0)


@pytest.mark.parametrize(
    "signals, wanted",
    [
        (load([0], [0], [0.0], [0.0]), 1),  # idle: the minimum
        (load([0], [8], [0.3], [0.2]), 1),  # full, nobody waiting: enough
        (load([12], [8], [0.3], [0.2]), 3),  # 20 requests for 8 slots: 3 replicas
        (load([0], [4], [0.99], [0.2]), 2),  # the KV cache is full
        (load([0], [4], [0.3], [5.0]), 3),  # first tokens 2.5× too slow
        (load([100], [8], [1.0], [60.0]), 4),  # no more than max_replicas
    ],
)
def test_one_replica_scales_on_each_signal(signals, wanted):
    assert POLICY(ctx(1, signals))[0] == wanted


def test_idle_replicas_scale_down_to_the_minimum_and_a_busy_one_holds_them():
    idle = load([0, 0, 0], [0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    assert POLICY(ctx(3, idle, low=2))[0] == 2
    half = load([0, 0, 0], [4, 4, 4], [0.2, 0.2, 0.2], [0.1, 0.1, 0.1])  # 12 for 24 slots
    assert POLICY(ctx(3, half))[0] == 2
    slow = load([0, 0, 0], [1, 0, 0], [0.0, 0.0, 0.0], [1.9, 0.0, 0.0])  # the worst replica's TTFT
    assert POLICY(ctx(3, slow))[0] == 3


def test_nothing_changes_before_a_replica_reports():
    assert POLICY(ctx(2, {}))[0] == 2
    assert POLICY(ctx(0, {}))[0] == 0


def test_the_autoscaling_args_give_serve_its_config_and_bound_the_ingress():
    args = ServeArgs(autoscaling={"min_replicas": 1, "max_replicas": 3})
    config = args.engine_config()
    scaling = args.autoscaling.serve_config(config.scheduler.max_num_seqs)
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (
        1,
        3,
        1,
    )
    assert scaling["policy"]["policy_kwargs"]["target_ongoing_requests"] == 128
    # The ingress takes what three replicas can hold; ranks are sized for the one at start.
    fixed = ServeArgs(num_engine_replicas=3)
    assert args.max_ongoing_requests(config) == fixed.max_ongoing_requests(config)
    assert args.initial_engine_replicas == 1
    with pytest.raises(ValidationError, match="max_replicas"):
        AutoscalingArgs(min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError, match="target_kv_usage"):
        ServeArgs(autoscaling={"target_kv_usage": 1.5})


def test_stats_while_a_new_replica_loads_count_it_without_failing():
    from iterserve.cluster.openai.operations import aggregate_stats

    serving = {"policy": "chunked", "num_running": 3, "slots_total": 8, "healthy": True}
    loading = {"replica": "new", "ready": False, "healthy": True, "counters": {}}
    stats = aggregate_stats([serving, loading], "m")
    assert stats["num_engine_replicas"] == 2 and stats["policy"] == "chunked"
    assert stats["num_running"] == 3 and stats["healthy"]
