"""Checkpoint loading: configs old and new, sharded weights, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
from plan_driver import PlanDriver
from test_runner_greedy import make_runner, prompts
from tiny_checkpoints import build_hf_model, edit_config, save

from iterserve.workers import CheckpointError, ModelConfig, load_checkpoint


@pytest.fixture
def llama_copy(checkpoint_dir, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir("llama"), path)
    return path


def test_parses_new_style_config(checkpoint_dir):
    config = load_checkpoint(checkpoint_dir("llama3")).config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 32)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["original_max_position_embeddings"] == 64


def test_parses_old_style_rope_fields():
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [5, 6],
    }
    config = ModelConfig.from_dict(raw)
    assert config.head_dim == 8 and config.num_kv_heads == 8
    assert config.rope_theta == 500000.0 and config.rope_scaling["factor"] == 8.0
    assert config.eos_token_ids == (5, 6)


def test_qwen2_biases_and_tied_embeddings(checkpoint_dir):
    ckpt = load_checkpoint(checkpoint_dir("qwen2"))
    layer = ckpt.config.layers[0]
    assert layer.qkv_bias and not layer.o_bias and ckpt.config.tie_word_embeddings
    assert "lm_head.weight" not in ckpt


def test_mistral_sliding_window_is_honoured_not_a_length_cap(checkpoint_dir):
    config = load_checkpoint(checkpoint_dir("mistral")).config
    assert [layer.window for layer in config.layers] == [24, 24]
    assert config.kv_window == 24
    assert config.max_model_len == config.max_position_embeddings


def test_sharded_checkpoint_gives_same_tokens(tmp_path, hf_reference, checkpoint_dir):
    checkpoint_dir("llama")
    path = save(build_hf_model("llama"), tmp_path / "sharded", max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*.safetensors"))) > 2
    prompt = prompts()[4]
    driver = PlanDriver(make_runner(path))
    driver.add("r", prompt)
    assert driver.run()["r"] == hf_reference("llama").greedy(prompt)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_missing_config(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json.*not found"):
        load_checkpoint(llama_copy)


def test_malformed_config_json(llama_copy):
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(llama_copy)


def test_missing_weights(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_checkpoint(llama_copy)


def test_missing_shard(tmp_path):
    path = save(build_hf_model("llama"), tmp_path / "sharded", max_shard_size="60KB")
    next(path.glob("model-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard .* is missing"):
        load_checkpoint(path)


def test_unsupported_architecture(llama_copy):
    edit_config(llama_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_checkpoint(llama_copy)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": None}, "'hidden_size' is missing"),
        ({"num_hidden_layers": "two"}, "'num_hidden_layers' must be a positive integer"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
        ({"hidden_act": "gelu"}, "'hidden_act' is 'gelu'; supported: silu"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
            "unsupported rope type 'dynamic'",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            "yarn rope scaling needs a numeric 'original_max_position_embeddings'",
        ),
        (
            {"quantization_config": {"quant_method": "bitsandbytes"}},
            "quantization_config.quant_method is 'bitsandbytes'; served: compressed-tensors",
        ),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.bits is missing"),
        (
            {"architectures": ["Gemma3ForConditionalGeneration"]},
            "unsupported architecture 'Gemma3ForConditionalGeneration'; supported: LlamaForCausalLM, "
            "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, "
            "MixtralForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM",
        ),
    ],
)
def test_bad_config_field(llama_copy, change, message):
    edit_config(llama_copy, **change)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(llama_copy)


def test_missing_tensor_is_named(llama_copy):
    edit_config(llama_copy, tie_word_embeddings=False, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\..* is missing"):
        make_runner(llama_copy)


def test_tensor_shape_mismatch_is_named(llama_copy):
    edit_config(llama_copy, intermediate_size=64)
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight has shape"):
        make_runner(llama_copy)


def test_generation_config_eos_is_merged(llama_copy):
    edit_config(llama_copy, eos_token_id=3)
    (llama_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 5]}))
    assert load_checkpoint(llama_copy).eos_token_ids == {3, 4, 5}
