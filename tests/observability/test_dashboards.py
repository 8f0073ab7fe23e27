"""The Grafana dashboards: well-formed, filtered by model, and in step with the code."""

from __future__ import annotations

import re
import subprocess

import pytest

from iterserve.cluster.metrics.engine import METRIC_NAMES
from tests.observability.prom import (
    PROMTOOL,
    all_panel_queries,
    families_in,
    iter_panels,
    load_dashboards,
)

DASHBOARDS = load_dashboards()
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_SELECTOR = re.compile(r"\b(iterserve_\w+)(\{[^}]*\})?")


def raw_queries():
    for name, dashboard in DASHBOARDS.items():
        for panel in iter_panels(dashboard):
            for target in panel.get("targets", []):
                yield name, panel, target


def test_the_three_dashboards_exist():
    assert set(DASHBOARDS) == {"serving-overview", "batching", "kv-cache"}


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_has_datasource_and_model_variables(name):
    dashboard = DASHBOARDS[name]
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["datasource"]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    model = variables["model_name"]
    assert model["type"] == "query" and model["multi"] and model["includeAll"]
    assert model["allValue"] == ".*"
    assert model["datasource"] == DATASOURCE
    assert re.fullmatch(r"label_values\(iterserve_\w+, ?model_name\)", model["definition"])
    assert families_in(model["definition"]) <= METRIC_NAMES


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_panels_have_unique_ids_layout_and_explanations(name):
    panels = list(iter_panels(DASHBOARDS[name]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        cell = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}  # fmt: skip
        assert not cells & cell, f"panel {panel['title']!r} overlaps another"
        cells |= cell
        if panel["type"] == "row":
            continue
        assert panel["title"] and len(panel["description"]) > 40, panel["title"]
        assert panel["datasource"] == DATASOURCE and panel["targets"], panel["title"]


def test_every_query_reads_only_defined_metrics_filtered_by_model():
    for name, panel, target in raw_queries():
        expr = target["expr"]
        assert target["datasource"] == DATASOURCE
        where = f"{name} / {panel['title']}: {expr}"
        assert families_in(expr) and families_in(expr) <= METRIC_NAMES, where
        for metric, matchers in _SELECTOR.findall(expr):
            assert 'model_name=~"$model_name"' in matchers, f"{metric} unfiltered in {where}"


def test_every_defined_metric_is_on_some_panel():
    queried = set().union(*(families_in(expr) for _, _, expr in all_panel_queries()))
    assert METRIC_NAMES - queried == set()


def test_dashboards_use_rates_and_quantiles():
    exprs = [expr for _, _, expr in all_panel_queries()]
    assert any("histogram_quantile(0.99," in e for e in exprs)
    assert any("rate(" in e for e in exprs)
    # A bare counter means nothing on a graph: every counter is read through a rate.
    for expr in exprs:
        for counter in re.findall(r"\biterserve_\w+_total\b", expr):
            assert re.search(rf"(rate|increase)\({counter}\{{", expr), expr


def test_panel_queries_are_ready_for_prometheus():
    queries = all_panel_queries()
    assert len(queries) >= 30
    for dashboard, title, expr in queries:
        assert "$" not in expr, (dashboard, title, expr)
        assert 'model_name=~".*"' in expr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (CI installs prometheus)")
def test_panel_queries_are_valid_promql(tmp_path):
    # promtool parses every expression of a rule file: each query as a recording rule.
    rules = ["groups:", "  - name: dashboards", "    rules:"]
    for i, (_, _, expr) in enumerate(all_panel_queries()):
        rules += [f"      - record: iterserve_dashboard:query_{i}", f"        expr: '{expr}'"]
    path = tmp_path / "rules.yml"
    path.write_text("\n".join(rules) + "\n")
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
