"""The builder's arguments, the example Serve config, and ``run_server``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml
from pydantic import ValidationError

from iterserve.cluster.serve.app import ServeArgs, build_app
from iterserve.cluster.serve.cli import load_config_file, run_server, serve_plan
from iterserve.cluster.serve.flags import FlagError
from tests.serve.conftest import _free_port, fake_engine
from tests.stand_ins import split

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "serve-config.example.yaml"


def test_the_example_config_names_the_builder_and_valid_args():
    (app,) = yaml.safe_load(EXAMPLE.read_text())["applications"]
    assert app["import_path"] == "iterserve.cluster.serve.app:build_app"
    args = ServeArgs.model_validate(app["args"])
    config = args.engine_config()
    assert config.scheduler.policy == "chunked" and args.num_engine_replicas == 1
    build_app(app["args"])  # binds the deployments without starting anything


@pytest.mark.parametrize(
    "args, word",
    [
        ({"num_engine_replicas": 0}, "num_engine_replicas"),
        ({"max_body_bytes": 10}, "max_body_bytes"),
        ({"unknown": 1}, "unknown"),
        ({"request_timeout_s": -1}, "request_timeout_s"),
        ({"tool_call_parser": "mistral"}, "tool_call_parser"),
        ({"cors_allowed_origins": "https://a.example"}, "cors_allowed_origins"),
    ],
)
def test_bad_builder_args_are_refused_by_name(args, word):
    with pytest.raises(ValidationError, match=word):
        ServeArgs.model_validate(args)


def test_bad_engine_config_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="unknown engine config keys: nope"):
        build_app({"config": {"nope": 1}})
    with pytest.raises(ValueError, match="policy"):
        run_server(config={"policy": "fastest"})
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        build_app({"config": {"max_num_seqs": 0}})
    with pytest.raises(ValueError, match="given twice"):
        ServeArgs(model="/a", config={"model": "/b"}).engine_config()


def test_config_files_are_yaml_or_json(tmp_path):
    (tmp_path / "c.yaml").write_text("policy: static\nmax_num_seqs: 4\n")
    (tmp_path / "c.json").write_text(json.dumps({"policy": "dynamic"}))
    (tmp_path / "bad.yaml").write_text("- a list\n")
    assert load_config_file(tmp_path / "c.yaml") == {"policy": "static", "max_num_seqs": 4}
    assert load_config_file(tmp_path / "c.json") == {"policy": "dynamic"}
    with pytest.raises(ValueError, match="mapping"):
        load_config_file(tmp_path / "bad.yaml")


def test_serve_subcommand_arguments(tmp_path):
    argv = ["--model", str(tmp_path), "--port", "9000", "--engine-replicas", "2"]
    args = serve_plan(argv).args
    assert (args.config["model"], args.http_port, args.num_engine_replicas) == (
        str(tmp_path), 9000, 2,
    )  # fmt: skip
    assert args.http_host == "127.0.0.1"
    assert not args.strict_fields and args.tool_call_parser is None
    assert args.cors_allowed_origins == [] and args.metrics_require_api_key is True


def test_serve_subcommand_compatibility_options():
    args = serve_plan(
        [
            "--strict-fields",
            "--tool-call-parser", "llama3_json",
            "--cors-allowed-origins", "https://a.example, https://b.example",
            "--cors-allow-credentials",
            "--metrics-without-api-key",
            "--api-key-env", "MY_KEY",
        ]
    ).args  # fmt: skip
    assert args.strict_fields and args.tool_call_parser == "llama3_json"
    assert args.cors_allowed_origins == ["https://a.example", "https://b.example"]
    assert args.cors_allow_credentials and args.metrics_require_api_key is False
    assert args.api_key_env == "MY_KEY"
    with pytest.raises(FlagError, match="--tool-call-parser nope: must be one of hermes"):
        serve_plan(["--tool-call-parser", "nope"])


def test_run_server_serves_a_config_file(serve_url, tokenizer_dir, vocab_size, tmp_path):
    from ray import serve

    config = tmp_path / "engine.yaml"
    engine, fake = split(fake_engine(vocab_size))
    config.write_text(yaml.safe_dump(engine))
    port = _free_port()  # Serve is already up on the session's Ray; its proxy's port is its own
    url = run_server(
        model=str(tokenizer_dir), config_file=str(config), port=port, model_name="m",
        block=False, executor=fake,
    )  # fmt: skip
    try:
        assert url == f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "m"
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        assert (
            httpx.post(f"{url}/v1/completions", json=body).json()["usage"]["completion_tokens"] == 2
        )
    finally:
        serve.delete("iterserve")


def test_no_stand_in_model_and_no_key_in_clear_is_a_setting_a_deployment_can_reach():
    """What runs on the ranks is code handed to build_app, never a config's word:
    the fake model, fault injection and executors by import path are out of reach
    of a Serve config, a Helm value or a CLI file. The API key comes from the
    environment of the ingress's node only."""
    for config in (
        {"executor": "fake"},
        {"executor": "tests.faults:faulty"},
        {"executor_options": {"output_len": 3, "fault_crash_at_step": 3}},
    ):
        with pytest.raises(ValueError, match="unknown engine config keys: executor"):
            build_app({"config": config})
    with pytest.raises(ValueError, match="api_key"):
        build_app({"api_key": "in-clear"})


def test_the_builder_a_serve_config_names_takes_its_args_alone():
    """Serve refuses a builder with any other parameter (it passes the config's
    args, nothing else); code hands a stand-in model to build_application."""
    import inspect

    assert list(inspect.signature(build_app).parameters) == ["args"]
