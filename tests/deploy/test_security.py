"""Ray's control ports stay inside the release; GPUs, secrets and the model are wired right.

Ray's GCS (6379), dashboard and Jobs API (8265) and client port (10001) run
arbitrary code for whoever reaches them: no Service of the chart exposes them
outside the cluster, and the NetworkPolicy admits them only from pods of the
same release (and, for the head's Serve REST API, the KubeRay operator).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import VARIANTS

RAY_PORTS = {6379, 8265, 10001}
EXTERNAL_SERVICE_TYPES = {"NodePort", "LoadBalancer"}


def _rendered(renders, variant: Path | None):
    return renders["defaults" if variant is None else variant.stem]


def _selector_labels(rendered) -> dict[str, str]:
    labels = rendered.rayservice["metadata"]["labels"]
    return {k: labels[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance")}


def _is_release_peer(peer: dict[str, Any], release: dict[str, str]) -> bool:
    """A peer that matches only pods of this release (in the policy's namespace)."""
    if set(peer) != {"podSelector"}:
        return False
    selector = peer["podSelector"]
    return set(selector) == {"matchLabels"} and release.items() <= selector["matchLabels"].items()


def _is_operator_peer(peer: dict[str, Any], values_operator: dict[str, Any]) -> bool:
    return peer == {
        "namespaceSelector": values_operator["namespaceSelector"],
        "podSelector": values_operator["podSelector"],
    }


def _admits(rule: dict[str, Any], port: int) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in p:
            return True
        if isinstance(p["port"], str):
            return True  # a named port could be anything: treat it as admitting
        end = p.get("endPort", p["port"])
        if p["port"] <= port <= end:
            return True
    return False


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policy_keeps_ray_ports_inside_the_release(renders, variant) -> None:
    rendered = _rendered(renders, variant)
    (policy,) = rendered.of_kind("NetworkPolicy")
    release = _selector_labels(rendered)
    spec = policy["spec"]
    assert "Ingress" in spec["policyTypes"]
    # The policy covers every Ray pod of the release: head and workers.
    assert spec["podSelector"]["matchLabels"] == release
    for template in rendered.pod_templates.values():
        assert release.items() <= template["metadata"]["labels"].items()

    operator = rendered.values["networkPolicy"]["kuberayOperator"]
    for port in sorted(RAY_PORTS):
        admitting = [r for r in spec["ingress"] if _admits(r, port)]
        # Same-release pods reach every Ray port (the cluster needs them)...
        assert any(
            any(_is_release_peer(p, release) for p in r.get("from", [])) for r in admitting
        ), f"port {port} is not open to pods of the release"
        for rule in admitting:
            peers = rule.get("from")
            assert peers, f"port {port} is open to any source: {rule}"
            for peer in peers:
                # ...and nothing else does, except the operator on the Serve REST API.
                allowed = _is_release_peer(peer, release) or (
                    port == 8265 and _is_operator_peer(peer, operator)
                )
                assert allowed, f"port {port} admits {peer}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policy_admits_the_api(renders, variant) -> None:
    rendered = _rendered(renders, variant)
    (policy,) = rendered.of_kind("NetworkPolicy")
    api_rules = [
        r
        for r in policy["spec"]["ingress"]
        if r.get("ports") == [{"protocol": "TCP", "port": 8000}]
    ]
    assert len(api_rules) == 1
    if variant is None:
        assert "from" not in api_rules[0]  # the default: any source
    for rule in policy["spec"]["ingress"]:
        ports = {p.get("port") for p in rule.get("ports", [])}
        assert not ports & RAY_PORTS or rule.get("from"), rule


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_service_exposes_ray_ports(renders, variant) -> None:
    rendered = _rendered(renders, variant)
    assert rendered.of_kind("Ingress") == []
    for service in rendered.of_kind("Service"):
        ports = {p["port"] for p in service["spec"]["ports"]}
        targets = {p.get("targetPort", p["port"]) for p in service["spec"]["ports"]}
        assert not ports & RAY_PORTS, service["metadata"]["name"]
        assert not targets & (RAY_PORTS | {"dashboard", "gcs-server", "client"})
        if service["spec"].get("type", "ClusterIP") in EXTERNAL_SERVICE_TYPES:
            assert ports == {8000} or targets == {"serve"}, service["metadata"]["name"]
    # KubeRay's own head Service (which carries 6379/8265/10001) stays internal.
    head = rendered.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert head.get("enableIngress") is False
    assert "serveService" not in rendered.rayservice["spec"]


def test_load_balancer_variant_carries_only_the_api(renders) -> None:
    (service,) = renders["public-lb-values"].of_kind("Service")
    assert service["spec"]["type"] == "LoadBalancer"
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(8000, "serve")]


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_does_no_gpu_work_and_workers_get_their_gpus(renders, variant) -> None:
    rendered = _rendered(renders, variant)
    cluster = rendered.rayservice["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    for container in rendered.head_template["spec"]["containers"]:
        for amounts in container.get("resources", {}).values():
            assert not any("gpu" in name for name in amounts), container["name"]
    group = rendered.worker_group
    (worker,) = group["template"]["spec"]["containers"]
    gpus = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    assert int(worker["resources"]["requests"]["nvidia.com/gpu"]) == gpus
    assert group["rayStartParams"]["num-gpus"] == str(gpus)
    tp = rendered.app_args["config"]["tensor_parallel_size"]
    assert gpus % tp == 0
    args = rendered.app_args
    copies = args.get("autoscaling", {}).get("max_replicas", args["num_engine_replicas"])
    pods = group["maxReplicas"] if cluster["enableInTreeAutoscaling"] else group["replicas"]
    assert copies <= pods * (gpus // tp)
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_api_key_reaches_every_ray_container(renders, variant) -> None:
    rendered = _rendered(renders, variant)
    args = rendered.app_args
    containers = [c for t in rendered.pod_templates.values() for c in t["spec"]["containers"]]
    if "api_key_env" not in args:
        for container in containers:
            assert not any(
                "secretKeyRef" in e.get("valueFrom", {}) for e in container.get("env", [])
            )
        assert rendered.of_kind("Secret") == []
        return
    secrets = {s["metadata"]["name"]: s for s in rendered.of_kind("Secret")}
    for container in containers:
        env = {e["name"]: e for e in container["env"]}
        ref = env[args["api_key_env"]]["valueFrom"]["secretKeyRef"]
        if secrets:
            assert ref["key"] in secrets[ref["name"]]["data"]
        assert "value" not in env[args["api_key_env"]]


def test_existing_secret_is_referenced_not_created(renders) -> None:
    rendered = renders["existing-secret-values"]
    assert rendered.of_kind("Secret") == []
    assert rendered.app_args["api_key_env"] == "ITERSERVE_KEY"
    (worker,) = rendered.worker_group["template"]["spec"]["containers"]
    (entry,) = [e for e in worker["env"] if e["name"] == "ITERSERVE_KEY"]
    assert entry["valueFrom"]["secretKeyRef"] == {
        "name": "iterserve-api-credentials",
        "key": "token",
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_is_mounted_read_only_where_the_app_looks(renders, variant) -> None:
    rendered = _rendered(renders, variant)
    model = rendered.app_args["model"]
    for role, template in rendered.pod_templates.items():
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (container,) = spec["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "model"]
        assert mount["readOnly"] is True, role
        assert model == mount["mountPath"] or model.startswith(mount["mountPath"].rstrip("/") + "/")
        volume = volumes["model"]
        if "persistentVolumeClaim" in volume:
            assert volume["persistentVolumeClaim"]["readOnly"] is True
            assert "initContainers" not in spec
        else:
            assert "emptyDir" in volume
            (init,) = spec["initContainers"]
            assert init["name"] == "copy-model"
            assert init["command"] == ["rclone"]
            assert init["args"][-1] == "/model"
            assert {"name": "model", "mountPath": "/model"} in init["volumeMounts"]


def test_copy_from_url_and_volume(renders) -> None:
    url = renders["copy-url-values"].head_template["spec"]["initContainers"][0]
    assert url["args"][-2:] == [":s3:models/llama-3.2-1b-instruct", "/model"]
    assert url["envFrom"] == [{"secretRef": {"name": "model-bucket-credentials"}}]
    volume_variant = renders["copy-volume-values"].worker_group["template"]["spec"]
    (init,) = volume_variant["initContainers"]
    assert init["args"][-2:] == ["/model-source/qwen2.5-0.5b-instruct", "/model"]
    volumes = {v["name"]: v for v in volume_variant["volumes"]}
    assert volumes["model-source"]["nfs"]["path"] == "/export/models"


def test_pvc_model_path_inside_the_claim(renders) -> None:
    rendered = renders["pvc-model-values"]
    assert rendered.app_args["model"] == "/mnt/models/llama-3.2-1b-instruct"
    volumes = {v["name"]: v for v in rendered.worker_group["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "llm-checkpoints"


def test_worker_readiness_uses_the_health_endpoint(renders) -> None:
    (worker,) = renders["defaults"].worker_group["template"]["spec"]["containers"]
    probe = worker["readinessProbe"]["httpGet"]
    assert probe == {"path": "/health", "port": 8000}
    assert "livenessProbe" not in worker  # KubeRay's own Ray health check
    (head,) = renders["defaults"].head_template["spec"]["containers"]
    assert "readinessProbe" not in head and "livenessProbe" not in head


def test_spread_variant_spreads_workers(renders) -> None:
    spec = renders["spread-values"].worker_group["template"]["spec"]
    (constraint,) = spec["topologySpreadConstraints"]
    assert constraint["topologyKey"] == "kubernetes.io/hostname"
    assert constraint["whenUnsatisfiable"] == "DoNotSchedule"
    assert constraint["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    cluster = renders["spread-values"].rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True


def test_probe_and_scrape_paths_follow_the_route_prefix(render) -> None:
    rendered = render(
        {"serve": {"routePrefix": "/llm"}, "serviceMonitor": {"enabled": True}},
    )
    assert rendered.serve_config["applications"][0]["route_prefix"] == "/llm"
    (worker,) = rendered.worker_group["template"]["spec"]["containers"]
    assert worker["readinessProbe"]["httpGet"]["path"] == "/llm/health"
    (endpoint,) = rendered.one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["path"] == "/llm/metrics"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_ray_container_starts_its_workers_at_nice_0(renders, variant) -> None:
    """Ray's default, nice 15, lets anything else in the pod take the CPU from the
    serving processes (proxy, ingress, scheduler, ranks)."""
    rendered = _rendered(renders, variant)
    for template in rendered.pod_templates.values():
        for container in template["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["RAY_worker_niceness"] == "0", container["name"]
