"""The chart lints cleanly and renders valid Kubernetes objects for every variant.

Core kinds are validated with kubernetes-validate's strict schemas (unknown
fields refused). The RayService and the ServiceMonitor are validated against
the CRD schemas of KubeRay and the Prometheus Operator, tightened the same way:
an object schema that lists its properties refuses others unless the CRD marks
it as preserving unknown fields. The RayService pod templates are also checked
as core v1 PodTemplates.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from .conftest import (
    CI_VALUES,
    KUBE_VERSION,
    SCHEMAS_DIR,
    VARIANTS,
    ci_values,
    helm,
    load_yaml,
)

CORE_KINDS = {"Service", "Secret", "ConfigMap", "NetworkPolicy"}
CRD_FILES = {
    ("ray.io/v1", "RayService"): "ray.io_rayservices.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
}


def _strict(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def crd_validator(filename: str) -> jsonschema.protocols.Validator:
    path = SCHEMAS_DIR / filename
    if not path.exists():
        pytest.skip(
            f"CRD schema {path} is missing (expected beside the repository in shared/schemas)"
        )
    crd = load_yaml(path)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft7Validator(schema)


def _errors(validator: jsonschema.protocols.Validator, doc: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def _values(variant: Path | None) -> dict[str, Any] | None:
    return None if variant is None else ci_values(variant)


def _id(variant: Path | None) -> str:
    return "defaults" if variant is None else variant.stem


def test_ci_values_exist() -> None:
    names = {p.stem for p in CI_VALUES}
    # The variants the chart promises to keep rendering.
    for expected in (
        "tp2-2gpu-values",
        "pvc-model-values",
        "copy-url-values",
        "servicemonitor-values",
        "existing-secret-values",
        "chunked-values",
        "spread-values",
    ):
        assert expected in names


@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_strict(staged_chart: Path, variant: Path | None) -> None:
    report = helm.lint(staged_chart, _values(variant), strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("variant", VARIANTS)
def test_renders_expected_kinds(renders, variant: Path | None) -> None:
    rendered = renders[_id(variant)]
    kinds = sorted(d["kind"] for d in rendered.docs)
    assert "RayService" in kinds
    for doc in rendered.docs:
        assert doc["metadata"]["name"].startswith("demo-iterserve")
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "demo"
    assert rendered.notes.strip()


@pytest.mark.parametrize("variant", VARIANTS)
def test_core_objects_are_valid(renders, variant: Path | None) -> None:
    rendered = renders[_id(variant)]
    for doc in rendered.docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_FILES:
            continue
        assert doc["kind"] in CORE_KINDS, f"unexpected kind {doc['kind']}"
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(map(str, e.absolute_path))
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {path}: {e.message}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_custom_resources_match_crds(renders, variant: Path | None) -> None:
    rendered = renders[_id(variant)]
    checked = 0
    for doc in rendered.docs:
        filename = CRD_FILES.get((doc["apiVersion"], doc["kind"]))
        if filename is None:
            continue
        errors = _errors(crd_validator(filename), doc)
        assert errors == [], f"{doc['kind']} does not match its CRD:\n" + "\n".join(errors)
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_pod_templates_are_valid_core_pod_templates(renders, variant: Path | None) -> None:
    rendered = renders[_id(variant)]
    for role, template in rendered.pod_templates.items():
        doc = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{role}-template"},
            "template": template,
        }
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(map(str, e.absolute_path))
            pytest.fail(f"{role} pod template: {path}: {e.message}")


def test_servicemonitor_variant_renders_servicemonitor(renders) -> None:
    rendered = renders["servicemonitor-values"]
    monitor = rendered.one("ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    service = rendered.one("Service")
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    # The API key doubles as the scrape credential.
    secret = rendered.one("Secret")
    assert endpoint["authorization"]["credentials"]["name"] == secret["metadata"]["name"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_servicemonitor_off_by_default(renders) -> None:
    assert renders["defaults"].of_kind("ServiceMonitor") == []
