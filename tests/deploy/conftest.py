"""Offline rendering of the Helm chart in deploy/helm/iterserve.

The chart is rendered with Helm's own Go SDK (``helm_python``), no cluster and
no helm binary. Most tests render a staged copy of the chart: the chart's
``dashboards`` entry is a link to the repository's ``grafana/`` folder, and the
copy follows it (or leaves the folder empty when ``grafana/`` is absent), so
these tests do not depend on which dashboards exist.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "iterserve"
CI_VALUES = sorted((CHART_DIR / "ci").glob("*.yaml"))
SCHEMAS_DIR = REPO_ROOT.parent / "shared" / "schemas"
RELEASE = "demo"
NAMESPACE = "llm"
KUBE_VERSION = "1.30.0"

try:
    _Loader = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML without libyaml
    _Loader = yaml.SafeLoader


def load_yaml(path: Path) -> Any:
    with open(path) as f:
        return yaml.load(f, Loader=_Loader)


def stage_chart(dest: Path, dashboards: dict[str, str] | None = None) -> Path:
    """Copies the chart to ``dest``; ``dashboards`` replaces the dashboards folder."""
    chart = dest / "iterserve"
    shutil.copytree(
        CHART_DIR,
        chart,
        ignore=lambda d, names: ["dashboards"] if Path(d) == CHART_DIR else [],
    )
    target = chart / "dashboards"
    if dashboards is not None:
        target.mkdir()
        for name, text in dashboards.items():
            (target / name).write_text(text)
    elif (CHART_DIR / "dashboards").is_dir():
        shutil.copytree(CHART_DIR / "dashboards", target)
    else:
        target.mkdir()
    return chart


class RenderedChart:
    """One rendering: the manifests as parsed documents, NOTES.txt, and the values used."""

    def __init__(self, manifests: dict[str, str], values: dict[str, Any]) -> None:
        self.manifests = manifests
        self.values = values
        self.notes = ""
        self.docs: list[dict[str, Any]] = []
        for name, text in sorted(manifests.items()):
            if name.endswith("NOTES.txt"):
                self.notes = text
                continue
            for doc in yaml.load_all(text, Loader=_Loader):
                if doc:
                    self.docs.append(doc)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.of_kind(kind)
        assert len(found) == 1, f"expected one {kind}, got {len(found)}"
        return found[0]

    @property
    def rayservice(self) -> dict[str, Any]:
        return self.one("RayService")

    @property
    def serve_config(self) -> dict[str, Any]:
        return yaml.load(self.rayservice["spec"]["serveConfigV2"], Loader=_Loader)

    @property
    def app_args(self) -> dict[str, Any]:
        (app,) = self.serve_config["applications"]
        return app["args"]

    @property
    def head_template(self) -> dict[str, Any]:
        return self.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]

    @property
    def worker_group(self) -> dict[str, Any]:
        (group,) = self.rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        return group

    @property
    def pod_templates(self) -> dict[str, dict[str, Any]]:
        return {"head": self.head_template, "worker": self.worker_group["template"]}


@pytest.fixture(scope="session")
def staged_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stage_chart(tmp_path_factory.mktemp("chart"))


@pytest.fixture(scope="session")
def chart(staged_chart: Path):
    with helm.Chart.load(staged_chart) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart) -> Callable[..., RenderedChart]:
    def _render(values: dict[str, Any] | None = None, name: str = RELEASE) -> RenderedChart:
        manifests = chart.render(values, name=name, namespace=NAMESPACE)
        return RenderedChart(manifests, chart.merge_values(values))

    return _render


def ci_values(path: Path) -> dict[str, Any]:
    return load_yaml(path) or {}


VARIANTS = [pytest.param(None, id="defaults")] + [
    pytest.param(path, id=path.stem) for path in CI_VALUES
]


@pytest.fixture(scope="session")
def renders(render) -> dict[str, RenderedChart]:
    """Every variant rendered once: defaults and each ci/*.yaml file."""
    out = {"defaults": render(None)}
    for path in CI_VALUES:
        out[path.stem] = render(ci_values(path))
    return out
