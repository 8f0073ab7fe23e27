"""Merging engines' snapshots into one exposition, and promtool's verdict on it."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from iterserve.cluster.metrics.engine import METRIC_NAMES, SPECS, EngineMetrics
from iterserve.cluster.metrics.hub import SnapshotStore, render, render_local
from tests.observability.prom import PROMTOOL, promtool_check

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (apt-get install prometheus; CI does)"
)


def exposed_name(spec) -> str:
    return spec.name + "_total" if spec.kind == "counter" else spec.name


def engines_of(text: str, family: str) -> set[str]:
    return {
        s.labels["engine"]
        for f in text_string_to_metric_families(text)
        if f.name == family
        for s in f.samples
    }


def test_one_engine_renders_exactly_as_its_own_registry(busy_metrics):
    metrics = busy_metrics()
    assert render([metrics.snapshot()]) == metrics.exposition()


def test_merge_has_one_help_and_type_per_family_and_both_engines(busy_metrics):
    a, b = busy_metrics("demo", 0, "static"), busy_metrics("demo", 1, "continuous")
    text = render([a.snapshot(), b.snapshot()]).decode()
    for spec in SPECS:
        name = exposed_name(spec)
        assert len(re.findall(rf"^# HELP {name} ", text, re.M)) == 1, name
        assert len(re.findall(rf"^# TYPE {name} {spec.kind}$", text, re.M)) == 1, name
    assert len(re.findall(r"^# TYPE ", text, re.M)) == len(METRIC_NAMES)
    assert engines_of(text, "iterserve_requests_running") == {"0", "1"}
    assert engines_of(text, "iterserve_time_to_first_token_seconds") == {"0", "1"}
    assert 'iterserve_policy_info{engine="0",model_name="demo",policy="static"} 1.0' in text
    assert 'iterserve_policy_info{engine="1",model_name="demo",policy="continuous"} 1.0' in text


def test_render_local_merges_engines_of_this_process(busy_metrics):
    engines = [busy_metrics("a", 0), busy_metrics("b", 0)]
    assert render_local(engines) == render([m.snapshot() for m in engines])


def test_merge_drops_what_would_make_the_exposition_invalid(busy_metrics):
    metrics = busy_metrics()
    clash = [("iterserve_requests_running", "counter", "a clash", [])]
    foreign = [
        ("iterserve_rank_restarts", "counter", "x", [("other_total", {"engine": "9"}, 1.0)]),
        ("iterserve_slots_used", "gauge", "x", [("iterserve_slots_used", {"bad-label": "v"}, 1)]),
        ("unknown_family", "summary", "x", [("unknown_family_sum", {}, 1.0)]),
    ]
    twice = render([metrics.snapshot(), metrics.snapshot(), clash, foreign])
    assert twice == metrics.exposition()


def test_render_of_nothing_is_an_empty_exposition():
    assert render([]) == b""


@needs_promtool
def test_promtool_accepts_one_engine(busy_metrics):
    result = promtool_check(busy_metrics().exposition())
    assert (result.returncode, result.stdout + result.stderr) == (0, b"")


@needs_promtool
def test_promtool_accepts_two_merged_engines(busy_metrics):
    fresh = EngineMetrics("other-model", 0, "dynamic")  # families with no activity yet
    snapshots = [busy_metrics("demo", 0).snapshot(), busy_metrics("demo", 1).snapshot()]
    result = promtool_check(render([*snapshots, fresh.snapshot()]))
    assert (result.returncode, result.stdout + result.stderr) == (0, b"")


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_store_keeps_the_latest_snapshot_per_engine_and_forgets_silent_ones():
    clock = FakeClock()
    store = SnapshotStore(max_age_s=30.0, clock=clock)
    store.push("demo/1", ["old"])
    store.push("demo/0", ["zero"])
    store.push("demo/1", ["one"])
    assert store.collect() == [["zero"], ["one"]]  # ordered by engine key
    clock.now += 20
    store.push("demo/0", ["zero again"])
    clock.now += 15  # demo/1 last pushed 35 s ago
    assert store.collect() == [["zero again"]]
    store.remove("demo/0")
    assert store.collect() == []
