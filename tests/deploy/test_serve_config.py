"""The Serve config the chart renders (and the example one) runs iterserve's app.

The import path must name a module of this repository that defines the
builder, and the engine config must be one that iterserve's own EngineConfig
and SchedulerConfig accept.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pytest

from iterserve.cluster.config import EngineConfig

from .conftest import REPO_ROOT, VARIANTS, load_yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

IMPORT_PATH = "iterserve.cluster.serve.app:build_app"
APP_ARGS = {
    "model", "config", "num_engine_replicas", "api_key_env", "max_body_bytes", "http_host",
    "http_port", "request_timeout_s", "autoscaling",
}  # fmt: skip
EXAMPLE = REPO_ROOT / "deploy" / "serve-config.yaml"


def _module_file(module: str) -> Path:
    """Maps a dotted module of the project to its file, through pyproject's package-dir."""
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        package_dir: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        package = ".".join(parts[:cut])
        if package in package_dir:
            base = REPO_ROOT / package_dir[package]
            rest = parts[cut:]
            break
    else:
        pytest.fail(f"{module} is not in a package of this project")
    if not rest:
        return base / "__init__.py"
    package_init = base.joinpath(*rest, "__init__.py")
    return package_init if package_init.exists() else base.joinpath(*rest[:-1], rest[-1] + ".py")


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _check_engine_config(config: dict[str, Any]) -> None:
    engine = EngineConfig.from_dict(config)
    # What the scheduler will be built with once the checkpoint is known: the
    # cross-field rules (token budget vs slots and context) must hold.
    engine.scheduler.resolved(num_kv_blocks=1 << 20, max_model_len=2048, device="cuda")


def _the_app(serve_config: dict[str, Any]) -> dict[str, Any]:
    """The one application; it answers on port 8000, itself or through Serve's proxy."""
    (app,) = serve_config["applications"]
    if serve_config.get("proxy_location") == "Disabled":
        assert app["args"]["http_port"] == 8000
    else:
        assert serve_config["http_options"]["port"] == 8000
    return app


@pytest.mark.parametrize("variant", VARIANTS)
def test_serve_config_runs_the_iterserve_app(renders, variant) -> None:
    rendered = renders["defaults" if variant is None else variant.stem]
    app = _the_app(rendered.serve_config)
    assert app["import_path"] == IMPORT_PATH
    args = app["args"]
    assert set(args) <= APP_ARGS
    assert {"model", "config", "num_engine_replicas"} <= set(args)
    _check_engine_config(args["config"])


def test_import_path_names_a_builder_in_this_repository(renders) -> None:
    import_path = _the_app(renders["defaults"].serve_config)["import_path"]
    module, _, attr = import_path.partition(":")
    assert module and attr, f"{import_path!r} is not module:attr"
    path = _module_file(module)
    assert path.exists(), f"{import_path}: {path.relative_to(REPO_ROOT)} does not exist"
    assert attr in _top_level_names(path), f"{path.relative_to(REPO_ROOT)} defines no {attr}"


def test_example_serve_config_matches_the_chart(renders) -> None:
    example = load_yaml(EXAMPLE)
    app = _the_app(example)
    chart_app = _the_app(renders["defaults"].serve_config)
    assert app["import_path"] == chart_app["import_path"] == IMPORT_PATH
    assert set(app["args"]) <= APP_ARGS
    _check_engine_config(app["args"]["config"])
    # Every engine knob of the example is one the chart sets as well.
    assert set(app["args"]["config"]) <= set(chart_app["args"]["config"]) | {"num_kv_blocks"}


def test_chart_maps_engine_values_to_config(render) -> None:
    rendered = render(
        {
            "engine": {
                "policy": "dynamic",
                "maxNumSeqs": 8,
                "maxNumBatchedTokens": 1024,
                "maxModelLen": 1024,
                "numKvBlocks": 512,
                "tensorParallelSize": 2,
                "dtype": "float16",
                "batchWaitS": 0.05,
                "asyncScheduling": False,
            },
            "worker": {"gpus": 4},
            "serve": {"numEngineReplicas": 2, "maxBodyBytes": 65536},
        }
    )
    args = rendered.app_args
    config = args["config"]
    assert config["policy"] == "dynamic"
    assert config["max_num_seqs"] == 8
    assert config["max_model_len"] == 1024
    assert config["max_num_batched_tokens"] == 1024
    assert config["num_kv_blocks"] == 512  # kv_memory_fraction is then not used
    assert config["tensor_parallel_size"] == 2
    assert config["dtype"] == "float16"
    # Explicit, not auto: a replica may start before its GPU pod has joined the cluster.
    assert config["device"] == "cuda"
    assert config["batch_wait_s"] == 0.05
    assert config["async_scheduling"] is False
    assert args["num_engine_replicas"] == 2
    assert args["max_body_bytes"] == 65536
    assert "api_key_env" not in args
    _check_engine_config(config)


def test_optional_engine_values_are_left_to_the_engine(renders) -> None:
    config = renders["defaults"].app_args["config"]
    # 0 means "let the engine decide": the checkpoint's context, memory-sized cache.
    assert "max_model_len" not in config
    assert "num_kv_blocks" not in config
    assert 0 < config["kv_memory_fraction"] <= 1
    # The chart is for GPU pods: it sets the CUDA budget unless told 0 (by device).
    assert config["max_num_batched_tokens"] == 2048


def test_a_zero_step_budget_is_left_to_the_engine(render) -> None:
    config = render({"engine": {"maxNumBatchedTokens": 0}}).app_args["config"]
    assert "max_num_batched_tokens" not in config
    _check_engine_config(config)


def test_engine_autoscaling_values_become_the_apps_autoscaling(render) -> None:
    from iterserve.cluster.serve.app import ServeArgs
    from iterserve.cluster.serve.autoscaling import POLICY_PATH

    rendered = render(
        {
            "serve": {"engineAutoscaling": {"enabled": True, "maxReplicas": 3, "targetTtftS": 1.0}},
            "autoscaling": {"enabled": True},
            "worker": {"maxReplicas": 3},
        }
    )
    args = ServeArgs.model_validate(rendered.app_args)
    assert args.autoscaling is not None
    assert (args.autoscaling.min_replicas, args.autoscaling.max_replicas) == (1, 3)
    serve_config = args.autoscaling.serve_config(max_num_seqs=128)
    assert serve_config["policy"]["policy_function"] == POLICY_PATH
    assert serve_config["policy"]["policy_kwargs"] == {
        "target_ongoing_requests": 128,  # 0 in the chart: the engine's max_num_seqs
        "target_kv_usage": 0.9,
        "target_ttft_s": 1.0,
    }
    assert rendered.rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    # Off by default: a fixed count of engine replicas.
    assert "autoscaling" not in render({}).app_args


def test_upgrade_strategy_values_reach_the_rayservice(render) -> None:
    assert render({}).rayservice["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    spec = render(
        {"upgrade": {"strategy": "NewClusterWithIncrementalUpgrade", "gatewayClassName": "istio"}}
    ).rayservice["spec"]["upgradeStrategy"]
    assert spec["type"] == "NewClusterWithIncrementalUpgrade"
    assert spec["clusterUpgradeOptions"] == {
        "gatewayClassName": "istio",
        "stepSizePercent": 25,
        "intervalSeconds": 60,
        "maxSurgePercent": 25,
    }


def test_lora_modules_come_from_the_adapters_volume(render) -> None:
    rendered = render(
        {
            "lora": {
                "volume": {"persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}},
                "mountPath": "/adapters/",
                "modules": {"sql": "sql-lora", "chat": "/chat/"},
            },
            "engine": {"maxLoras": 4, "maxLoraRank": 64},
        }
    )
    config = rendered.app_args["config"]
    assert config["enable_lora"] is True
    assert config["lora_modules"] == {"sql": "/adapters/sql-lora", "chat": "/adapters/chat"}
    assert config["max_loras"] == 4 and config["max_lora_rank"] == 64
    _check_engine_config(config)
    (service,) = rendered.of_kind("RayService")
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    volumes = {v["name"]: v for v in head["volumes"]}
    assert volumes["lora-adapters"]["persistentVolumeClaim"]["claimName"] == "adapters"
    mounts = {m["name"]: m for m in head["containers"][0]["volumeMounts"]}
    assert mounts["lora-adapters"]["readOnly"] is True


def test_without_adapters_lora_stays_off(renders) -> None:
    config = renders["defaults"].app_args["config"]
    assert config["enable_lora"] is False and "lora_modules" not in config


def test_fair_scheduling_and_its_tenants_reach_the_engine_config(renders) -> None:
    config = renders["fair-values"].app_args["config"]
    assert config["scheduling_policy"] == "fair" and config["max_queue_len_per_tenant"] == 256
    assert config["tenants"] == {"chat": {"weight": 2, "ttft_slo_ms": 500}, "batch": {"weight": 1}}
    _check_engine_config(config)
    defaults = renders["defaults"].app_args["config"]
    assert defaults["scheduling_policy"] == "priority" and "tenants" not in defaults
    assert "max_queue_len_per_tenant" not in defaults


def test_the_kv_disk_tier_is_a_volume_mounted_where_the_engine_writes(render) -> None:
    rendered = render(
        {
            "kvDiskCache": {"volume": {"emptyDir": {"sizeLimit": "20Gi"}}},
            "kvEventsConfig": {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"},
            "engine": {"kvOffloadingSize": 4, "kvDiskCacheSize": 16},
        }
    )
    config = rendered.app_args["config"]
    assert config["kv_disk_cache_dir"] == "/var/cache/iterserve-kv"
    assert config["kv_offloading_size"] == 4 and config["kv_disk_cache_size"] == 16
    assert config["kv_events_config"]["enable_kv_cache_events"] is True
    _check_engine_config(config)
    for pod in rendered.pod_templates.values():
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["kv-disk-cache"]["emptyDir"] == {"sizeLimit": "20Gi"}
        mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["kv-disk-cache"]["mountPath"] == "/var/cache/iterserve-kv"
        assert not mounts["kv-disk-cache"].get("readOnly")


def test_without_a_disk_volume_the_engine_has_no_disk_tier(renders) -> None:
    config = renders["defaults"].app_args["config"]
    assert "kv_disk_cache_dir" not in config and config["kv_offloading_size"] == 0
