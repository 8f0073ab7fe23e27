"""Grafana dashboards reach the cluster from the repository's grafana/ folder.

The chart holds no copy: its `dashboards` entry is a link to ../../../grafana
that Helm follows when it loads the chart, and the ConfigMap template globs
`dashboards/*.json` at render time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import kubernetes_validate
import pytest

from .conftest import (
    CHART_DIR,
    KUBE_VERSION,
    NAMESPACE,
    REPO_ROOT,
    RenderedChart,
    helm,
    stage_chart,
)

GRAFANA = REPO_ROOT / "grafana"
CONFIGMAP_LIMIT = 1024 * 1024


def _dashboard(title: str) -> str:
    return json.dumps({"title": title, "uid": title.lower(), "panels": [], "schemaVersion": 39})


def _render_with(tmp_path: Path, dashboards: dict[str, str], values=None) -> RenderedChart:
    with helm.Chart.load(stage_chart(tmp_path, dashboards)) as chart:
        return RenderedChart(
            chart.render(values, name="demo", namespace=NAMESPACE), chart.merge_values(values)
        )


def test_dashboards_entry_links_to_the_grafana_folder() -> None:
    link = CHART_DIR / "dashboards"
    assert link.is_symlink(), "deploy/helm/iterserve/dashboards must link to grafana/, not copy it"
    assert os.readlink(link) == "../../../grafana"
    assert Path(os.path.normpath(link.parent / os.readlink(link))) == GRAFANA


def test_configmap_carries_each_dashboard(tmp_path: Path) -> None:
    dashboards = {
        "iterserve-overview.json": _dashboard("Overview"),
        "iterserve-scheduler.json": _dashboard("Scheduler"),
        "README.md": "not a dashboard",
    }
    rendered = _render_with(tmp_path, dashboards)
    configmap = rendered.one("ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(configmap["data"]) == {"iterserve-overview.json", "iterserve-scheduler.json"}
    for name, text in configmap["data"].items():
        assert json.loads(text) == json.loads(dashboards[name])
    kubernetes_validate.validate(configmap, KUBE_VERSION, strict=True)


def test_sidecar_label_and_folder_are_configurable(tmp_path: Path) -> None:
    values = {
        "dashboards": {
            "label": "grafana.com/dashboard",
            "labelValue": "iterserve",
            "annotations": {"grafana_folder": "LLM"},
        }
    }
    rendered = _render_with(tmp_path, {"a.json": _dashboard("A")}, values)
    configmap = rendered.one("ConfigMap")
    assert configmap["metadata"]["labels"]["grafana.com/dashboard"] == "iterserve"
    assert "grafana_dashboard" not in configmap["metadata"]["labels"]
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}


def test_no_dashboards_no_configmap(tmp_path: Path) -> None:
    assert _render_with(tmp_path, {}).of_kind("ConfigMap") == []


def test_dashboards_can_be_turned_off(tmp_path: Path) -> None:
    rendered = _render_with(
        tmp_path, {"a.json": _dashboard("A")}, {"dashboards": {"enabled": False}}
    )
    assert rendered.of_kind("ConfigMap") == []


def test_dashboard_file_names_must_be_configmap_keys(tmp_path: Path) -> None:
    with pytest.raises(helm.HelmRenderError, match="a ConfigMap key may only hold"):
        _render_with(tmp_path, {"my dashboard.json": _dashboard("A")})


def test_chart_loads_in_place_with_the_repository_dashboards() -> None:
    """`helm install deploy/helm/iterserve` works from a checkout: the link resolves."""
    assert GRAFANA.is_dir(), (
        "grafana/ is missing: the chart's dashboards link dangles and Helm refuses to load "
        "the chart; keep at least one dashboard in grafana/"
    )
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = RenderedChart(chart.render(None, name="demo", namespace=NAMESPACE), {})
    expected = {p.name for p in GRAFANA.glob("*.json")}
    configmaps = rendered.of_kind("ConfigMap")
    if not expected:
        assert configmaps == []
        return
    (configmap,) = configmaps
    assert set(configmap["data"]) == expected
    for name, text in configmap["data"].items():
        assert text == (GRAFANA / name).read_text()
        json.loads(text)
    size = sum(len(k) + len(v.encode()) for k, v in configmap["data"].items())
    assert size < CONFIGMAP_LIMIT, f"the dashboards ConfigMap holds {size} bytes (limit 1 MiB)"
