"""vLLM's LoRA flags on ``iterserve serve`` and the engine config keys they set."""

from __future__ import annotations

import pytest

from iterserve.cluster.config import EngineConfig
from iterserve.cluster.serve.cli import serve_plan


def parse(*argv: str) -> dict:
    """The LoRA keys a command line sets (as the CLI hands them to the engine config)."""
    config = serve_plan(list(argv)).args.config
    keys = ("enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras")
    return {k: v for k, v in config.items() if k in keys}


def test_vllm_flags_become_engine_config_keys():
    config = parse(
        "--enable-lora", "--lora-modules", "sql=/adapters/sql",
        '{"name": "chat", "path": "/adapters/chat", "base_model_name": "llama"}',
        "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8",
    )  # fmt: skip
    assert config == {
        "enable_lora": True,
        "lora_modules": {
            "sql": {"path": "/adapters/sql", "base_model_name": None},
            "chat": {"path": "/adapters/chat", "base_model_name": "llama"},
        },
        "max_loras": 4,
        "max_lora_rank": 64,
        "max_cpu_loras": 8,
    }
    engine = EngineConfig.from_dict(config)
    assert engine.scheduler.max_loras == 4 and engine.rank_max_loras == 4
    assert parse() == {}


def test_lora_modules_imply_enable_lora_and_bad_entries_are_named():
    engine = EngineConfig.from_dict({"lora_modules": {"sql": "/adapters/sql"}})
    assert engine.enable_lora and engine.lora_modules["sql"]["path"] == "/adapters/sql"
    assert EngineConfig().rank_max_loras == 0  # LoRA off: the ranks hold no slots
    with pytest.raises(ValueError, match="lora_modules.sql: a path"):
        EngineConfig.from_dict({"lora_modules": {"sql": 3}})
    with pytest.raises(ValueError, match="max_lora_rank must be <= 64"):
        EngineConfig.from_dict({"max_lora_rank": 128})
    with pytest.raises(SystemExit):
        parse("--lora-modules", "no-equals-sign")
