"""``iterserve serve``'s flags: generated from the declarations, named as vLLM names
them, mapped to the config keys. A held-out set of vLLM command lines for a model
this engine serves parses unchanged but for the program's name; nothing starts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex

import pytest
import yaml

from iterserve.cluster import config_docs
from iterserve.cluster.serve import flags as flags_module
from iterserve.cluster.serve.app import ServeArgs
from iterserve.cluster.serve.cli import API_KEY_ENV, serve_parser, serve_plan
from iterserve.cluster.serve.flags import FlagError, human_int, serve_flags
from iterserve.cluster.serve.model_files import ModelNotFoundError, resolve_model
from iterserve.cluster.serve.vllm_flags import VLLM_FLAGS


@pytest.fixture
def model(tmp_path):
    """A directory standing for a checkpoint (nothing is loaded while parsing)."""
    path = tmp_path / "Qwen2.5-0.5B-Instruct"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def plan(model, line: str, cwd=None):
    """The plan of ``vllm serve``'s command line ``line``, MODEL standing for the model."""
    argv = shlex.split(line.replace("MODEL", str(model)))
    assert argv[:2] == ["vllm", "serve"]
    return serve_plan(argv[2:])


# vLLM command lines as vLLM's docs, recipes and deployment guides write them.
HELD_OUT = [
    "vllm serve MODEL --dtype bfloat16 --max-model-len 4096 --max-num-seqs 64 "
    "--tensor-parallel-size 2 --enable-prefix-caching --gpu-memory-utilization 0.9",
    "vllm serve MODEL --host 0.0.0.0 --port 8000 --api-key token-abc123",
    "vllm serve MODEL --served-model-name qwen --max-model-len 32k --enforce-eager "
    "--trust-remote-code --disable-log-requests",
    "vllm serve MODEL --enable-auto-tool-choice --tool-call-parser hermes",
    "vllm serve MODEL --enable-chunked-prefill --max-num-batched-tokens 2048 "
    "--uvicorn-log-level warning --disable-log-stats",
    "vllm serve MODEL --data-parallel-size 2 --seed 0 --generation-config vllm --swap-space 16",
    "vllm serve MODEL --enable-lora --lora-modules sql-lora=/adapters/sql --max-lora-rank 64 "
    "--max-loras 4",
    'vllm serve MODEL --speculative-config \'{"method": "ngram", "num_speculative_tokens": 5, '
    '"prompt_lookup_max": 4}\'',
    "vllm serve MODEL --kv-cache-dtype auto --load-format safetensors --block-size 16 "
    "--no-enable-prefix-caching -tp 1",
    "vllm serve MODEL --reasoning-parser deepseek_r1 --max_model_len=8192 -O3",
    "vllm serve MODEL --distributed-executor-backend ray --pipeline-parallel-size 1 "
    "--max-parallel-loading-workers 2 --scheduling-policy priority --async-scheduling",
    "vllm serve MODEL --allowed-origins '[\"*\"]' --allow-credentials --max-logprobs 5 "
    "--served-model-name a b --dtype half --compilation-config '{\"level\": 3}'",
    "vllm serve --model MODEL --no-enable-chunked-prefill --disable-custom-all-reduce "
    "--num-gpu-blocks-override 512 --preemption-mode recompute",
]


@pytest.mark.parametrize("line", HELD_OUT)
def test_a_vllm_command_line_parses_unchanged(model, line):
    p = plan(model, line)
    assert p.args.engine_config().model_path == str(model)
    assert isinstance(p.args, ServeArgs)


def test_the_first_held_out_line_sets_every_knob_it_names(model):
    p = plan(model, HELD_OUT[0])
    config = p.args.engine_config()
    assert config.dtype == "bfloat16" and config.tensor_parallel_size == 2
    assert config.scheduler.max_model_len == 4096 and config.scheduler.max_num_seqs == 64
    assert config.scheduler.enable_prefix_caching is True
    assert config.kv_memory_fraction == 0.9  # --gpu-memory-utilization: docs/serving.md
    assert (p.args.http_host, p.args.http_port) == ("127.0.0.1", 8000)  # vLLM's port


def test_vllm_meanings_map_onto_the_knobs(model):
    config = plan(model, HELD_OUT[4]).args.engine_config()
    assert config.scheduler.policy == "chunked" and config.scheduler.max_num_batched_tokens == 2048
    assert plan(model, HELD_OUT[-1]).args.engine_config().scheduler.policy == "continuous"
    args = plan(model, HELD_OUT[5]).args
    assert args.num_engine_replicas == 2 and args.generation_config == "vllm"
    assert args.engine_config().seed == 0
    args = plan(model, HELD_OUT[11]).args
    assert args.model_name == ["a", "b"] and args.engine_config().dtype == "float16"
    assert args.cors_allowed_origins == ["*"] and args.cors_allow_credentials is True
    config = plan(model, HELD_OUT[2]).args.engine_config()
    assert config.scheduler.max_model_len == 32000  # vLLM's 32k (32K: 32768)
    assert plan(model, HELD_OUT[9]).args.engine_config().reasoning_parser == "deepseek_r1"
    assert plan(model, HELD_OUT[12]).args.engine_config().scheduler.num_kv_blocks == 512


def test_the_api_key_travels_in_the_environment_not_the_config(model):
    p = plan(model, HELD_OUT[1])
    assert p.api_key == "token-abc123" and p.args.api_key_env == API_KEY_ENV
    assert "token-abc123" not in p.args.model_dump_json()
    assert (p.args.http_host, p.args.http_port) == ("0.0.0.0", 8000)


def test_lora_and_speculation_flags_become_their_keys(model):
    config = plan(model, HELD_OUT[6]).args.engine_config()
    assert config.enable_lora and config.scheduler.max_loras == 4 and config.max_lora_rank == 64
    assert config.lora_modules == {"sql-lora": {"path": "/adapters/sql", "base_model_name": None}}
    config = plan(model, HELD_OUT[7]).args.engine_config()
    assert config.scheduler.speculation.num_speculative_tokens == 5


def test_flags_that_tune_what_iterserve_does_its_own_way_are_accepted_with_a_log_line(model):
    notes = plan(model, HELD_OUT[2]).notes
    assert [n.split(":")[0] for n in notes] == [
        "--enforce-eager", "--trust-remote-code", "--disable-log-requests",
    ]  # fmt: skip
    assert all("accepted, nothing to do" in n for n in notes)


@pytest.mark.parametrize(
    "line, sentence",
    [
        ("--pipeline-parallel-size 2", "--pipeline-parallel-size 2: vLLM's flag is not "
         "implemented by iterserve (iterserve splits a model by tensor parallelism only)"),
        ("--kv-transfer-config {}", "--kv-transfer-config {}: vLLM's flag is not implemented"),
        ("--enable-expert-parallel", "--enable-expert-parallel: vLLM's flag is not implemented"),
        ("--enable-auto-tool-choice", "--enable-auto-tool-choice requires --tool-call-parser"),
        ("--max-num-seqs 0", "--max-num-seqs 0: max_num_seqs must be >= 1, got 0"),
        ("--data-parallel-size 0", "--data-parallel-size 0: Input should be greater than"),
        ("--policy static --enable-chunked-prefill",
         "--policy and --enable-chunked-prefill contradict each other"),
        ("--api-key k --api-key-env VAR", "--api-key and --api-key-env both name the key"),
    ],
)  # fmt: skip
def test_refusals_are_one_sentence(model, line, sentence, capsys):
    with pytest.raises((FlagError, SystemExit)) as raised:
        serve_plan([str(model), *shlex.split(line)])
    if raised.type is SystemExit:
        message = capsys.readouterr().err
        assert raised.value.code == 2 and message.count("\n") == 1, message
    else:
        message = str(raised.value)
    assert sentence in message, message


def test_a_model_given_twice_differently_is_refused(model, tmp_path):
    with pytest.raises(FlagError, match="given twice"):
        serve_plan([str(model), "--model", str(tmp_path)])
    assert serve_plan([str(model), "--model", str(model)]).args.engine_config().model == str(model)


def test_every_knob_and_ingress_setting_is_a_flag_once():
    flags = serve_flags()
    keys = [f.key for f in flags if f.target != flags_module.CLI]
    names = {k.name for k in config_docs.knobs()} | set(ServeArgs.model_fields)
    assert names - {"config"} <= set(keys)
    options = [o for f in flags for o in f.options]
    assert len(options) == len(set(options))
    parser, _ = serve_parser()  # argparse refuses two arguments with one option string
    assert isinstance(parser, argparse.ArgumentParser)


def test_a_knob_added_later_gets_its_flag_without_an_edit(monkeypatch):
    """What another change's knob gets: a flag named as the key, in its group."""
    knob = config_docs.knobs()[0]
    added = dataclasses.replace(knob, name="kv_cache_dtype", kind="str", default="auto",
                                meta={**knob.meta, "choices": ("auto", "fp8")})  # fmt: skip
    monkeypatch.setattr(flags_module, "knobs", lambda: [*config_docs.knobs(), added])
    flag = next(f for f in serve_flags() if f.key == "kv_cache_dtype")
    assert flag.name == "--kv-cache-dtype" and flag.group == "CacheConfig"
    vllm_rows = flags_module.vllm_only_flags(serve_flags())
    assert "--kv-cache-dtype" not in {n for v in vllm_rows for n in v.names}


def test_vllm_flags_as_data_have_unique_names_and_a_reason():
    names = [n for v in VLLM_FLAGS for n in v.names]
    assert len(names) == len(set(names))
    assert all(v.why and v.group for v in VLLM_FLAGS)


def test_help_groups_flags_as_vllm_does(capsys):
    parser, _ = serve_parser()
    text = parser.format_help()
    order = [
        text.index(f"\n{g}:\n")
        for g in (
            "Frontend",
            "ModelConfig",
            "ParallelConfig",
            "CacheConfig",
            "LoRAConfig",
            "SchedulerConfig",
        )
    ]
    assert order == sorted(order)
    model_config = text[text.index("\nModelConfig:\n") : text.index("\nLoadConfig:\n")]
    assert "--max-model-len" in model_config and "--served-model-name" in model_config
    assert "--gpu-memory-utilization" in text[text.index("\nCacheConfig:\n") :]


def test_a_config_file_takes_keys_or_flag_names_and_a_flag_wins(model, tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({
        "max-num-seqs": 32, "max_model_len": 2048, "gpu-memory-utilization": 0.5,
        "enable-prefix-caching": False, "policy": "continuous", "enforce-eager": True,
        "served-model-name": "from-file",
    }))  # fmt: skip
    p = serve_plan([str(model), "--config", str(path), "--max-num-seqs", "64"])
    config = p.args.engine_config()
    assert config.scheduler.max_num_seqs == 64 and config.scheduler.max_model_len == 2048
    assert config.kv_memory_fraction == 0.5 and not config.scheduler.enable_prefix_caching
    assert p.args.model_name == "from-file" and len(p.notes) == 1
    line = flags_module.startup_line(p.settings)
    assert "max_num_seqs=64 (--max-num-seqs; the config file's 32)" in line
    assert "max_model_len=2048 (config file)" in line
    path.write_text(json.dumps({"no_such_key": 1}))
    with pytest.raises(FlagError, match="config file: unknown key 'no_such_key'"):
        serve_plan(["--config", str(path)])


def test_vllm_int_spellings():
    assert [human_int(t) for t in ("2048", "8k", "8K", "1.5m", "1M")] == [
        2048, 8000, 8192, 1_500_000, 1 << 20,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="must be an integer"):
        human_int("lots")


def test_a_hub_id_is_found_in_the_local_cache_and_served_under_its_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--Org--Tiny-1B"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert resolve_model("Org/Tiny-1B") == (str(repo / "snapshots" / "abc123"), True)
    p = serve_plan(["Org/Tiny-1B"])
    assert p.args.model_name == "Org/Tiny-1B"
    with pytest.raises(ModelNotFoundError, match="iterserve downloads nothing"):
        resolve_model("Org/Missing")
