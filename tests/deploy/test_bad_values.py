"""Bad values stop the install with a message that names what to change.

Types, ranges, enums and unknown keys are refused by values.schema.json before
anything renders; contradictions between values are refused by the templates.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import NAMESPACE, helm

NO_PVC = {"pvc": {"claimName": ""}}

CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    # The schema: types, minimums, enums, unknown keys, required sections.
    ("negative-replicas", {"worker": {"replicas": -1}}, ["/worker/replicas", "minimum"]),
    ("negative-max-replicas", {"worker": {"maxReplicas": -2}}, ["/worker/maxReplicas"]),
    ("zero-gpus", {"worker": {"gpus": 0}}, ["/worker/gpus", "minimum"]),
    ("gpus-as-string", {"worker": {"gpus": "2"}}, ["/worker/gpus", "want integer"]),
    (
        "unknown-policy",
        {"engine": {"policy": "greedy"}},
        ["/engine/policy", "'static', 'dynamic', 'continuous', 'chunked'"],
    ),
    ("unknown-dtype", {"engine": {"dtype": "int4"}}, ["/engine/dtype"]),
    ("kv-fraction-zero", {"engine": {"kvMemoryFraction": 0}}, ["/engine/kvMemoryFraction"]),
    ("kv-fraction-above-one", {"engine": {"kvMemoryFraction": 1.5}}, ["/engine/kvMemoryFraction"]),
    ("zero-engine-replicas", {"serve": {"numEngineReplicas": 0}}, ["/serve/numEngineReplicas"]),
    ("misspelt-key", {"engine": {"maxNumSeq": 8}}, ["/engine", "maxNumSeq"]),
    ("model-section-removed", {"model": None}, ["missing property 'model'"]),
    (
        "url-scheme",
        {"model": {**NO_PVC, "copy": {"url": "ftp://host/model"}}},
        ["/model/copy/url"],
    ),
    ("bad-env-name", {"apiKey": {"envName": "API-KEY"}}, ["/apiKey/envName"]),
    ("service-type", {"service": {"type": "ExternalName"}}, ["/service/type"]),
    # The templates: values that contradict each other.
    (
        "tp-does-not-divide-gpus",
        {"engine": {"tensorParallelSize": 2}, "worker": {"gpus": 3}},
        ["engine.tensorParallelSize (2) does not divide worker.gpus (3)"],
    ),
    (
        "tp-larger-than-gpus",
        {"engine": {"tensorParallelSize": 4}, "worker": {"gpus": 2}},
        ["engine.tensorParallelSize (4) is larger than worker.gpus (2)"],
    ),
    (
        "engine-copies-do-not-fit",
        {"serve": {"numEngineReplicas": 3}},
        ["serve.numEngineReplicas (3) is not satisfiable", "raise worker.replicas"],
    ),
    (
        "engine-copies-beyond-autoscaler-ceiling",
        {
            "autoscaling": {"enabled": True},
            "worker": {"gpus": 2, "maxReplicas": 2},
            "engine": {"tensorParallelSize": 2},
            "serve": {"numEngineReplicas": 3},
        },
        ["serve.numEngineReplicas (3) is not satisfiable", "raise worker.maxReplicas"],
    ),
    (
        "engine-autoscaling-beyond-the-pods",
        {"serve": {"engineAutoscaling": {"enabled": True, "maxReplicas": 3}}},
        ["serve.engineAutoscaling.maxReplicas (3) is not satisfiable", "raise worker.replicas"],
    ),
    (
        "engine-autoscaling-min-above-max",
        {"serve": {"engineAutoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}}},
        ["serve.engineAutoscaling.minReplicas (3) is larger than"],
    ),
    (
        "incremental-upgrade-without-gateway",
        {"upgrade": {"strategy": "NewClusterWithIncrementalUpgrade"}},
        ["needs upgrade.gatewayClassName"],
    ),
    ("unknown-upgrade-strategy", {"upgrade": {"strategy": "Rolling"}}, ["/upgrade/strategy"]),
    (
        "no-model-source",
        {"model": NO_PVC},
        ["no model source", "model.pvc.claimName", "model.copy.url", "model.copy.volume"],
    ),
    (
        "two-model-sources",
        {"model": {"copy": {"url": "s3://bucket/model"}}},
        ["more than one model source (model.pvc.claimName, model.copy.url)"],
    ),
    (
        "min-above-max",
        {"worker": {"minReplicas": 3, "maxReplicas": 2, "replicas": 2}},
        ["worker.minReplicas (3) is larger than worker.maxReplicas (2)"],
    ),
    (
        "replicas-outside-bounds",
        {"worker": {"replicas": 5, "maxReplicas": 4}},
        ["worker.replicas (5) must lie between"],
    ),
    (
        "budget-below-slots",
        {"engine": {"maxNumSeqs": 256, "maxNumBatchedTokens": 128}},
        ["engine.maxNumBatchedTokens (128) must be >= engine.maxNumSeqs (256)"],
    ),
    (
        "whole-prompt-policy-budget",
        {"engine": {"policy": "continuous", "maxModelLen": 8192}},
        ["policy continuous prefills whole prompts", "engine.maxModelLen (8192)"],
    ),
    (
        "fair-with-whole-batches",
        {"engine": {"policy": "static", "schedulingPolicy": "fair"}},
        ["engine.schedulingPolicy fair", "engine.policy static admits a whole batch"],
    ),
    (
        "tenants-without-fair",
        {"tenants": {"chat": {"weight": 2}}},
        ["tenants and engine.maxQueueLenPerTenant apply to engine.schedulingPolicy fair only"],
    ),
    ("tenant-unknown-setting", {"tenants": {"chat": {"share": 2}}}, ["/tenants/chat", "share"]),
    ("tenant-weight-zero", {"tenants": {"chat": {"weight": 0}}}, ["/tenants/chat/weight"]),
    (
        "api-key-without-key",
        {"apiKey": {"enabled": True}},
        ["apiKey.enabled is true but no key is given"],
    ),
    (
        "api-key-twice",
        {"apiKey": {"enabled": True, "existingSecret": "s", "value": "k"}},
        ["either apiKey.existingSecret or apiKey.value"],
    ),
    (
        "gpu-on-head",
        {"head": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
        ["head does no GPU work"],
    ),
    (
        "servicemonitor-without-service",
        {"serviceMonitor": {"enabled": True}, "service": {"enabled": False}},
        ["serviceMonitor.enabled needs service.enabled"],
    ),
]


@pytest.mark.parametrize(("values", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_values_fail_with_a_clear_message(chart, values, expected) -> None:
    with pytest.raises(helm.HelmError) as caught:
        chart.render(values, name="demo", namespace=NAMESPACE)
    assert isinstance(caught.value, helm.HelmValuesError | helm.HelmRenderError)
    message = str(caught.value)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_release_name_must_make_a_valid_rayservice_name(chart) -> None:
    with pytest.raises(helm.HelmRenderError, match="is not a DNS-1035 label"):
        chart.render(None, name="1st", namespace=NAMESPACE)


def test_long_release_names_are_cut_to_kuberays_limit(render) -> None:
    rendered = render(None, name="a-very-long-release-name-for-a-large-llm-deployment")
    name = rendered.rayservice["metadata"]["name"]
    assert len(name) <= 47 and not name.endswith("-")


def test_lint_reports_bad_values(staged_chart) -> None:
    report = helm.lint(staged_chart, {"worker": {"replicas": -1}}, strict=True)
    assert any("/worker/replicas" in e for e in report["errors"]), report
