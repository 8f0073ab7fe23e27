"""Tiny random Hugging Face checkpoints, written with transformers for the tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    initializer_range=0.1,
)

# name -> (transformers class names, config overrides)
SPECS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"head_dim": 16}),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "head_dim": 32,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 32, "sliding_window": 4096}),
}


def build_hf_model(name: str, seed: int = 0):
    import transformers

    config_cls, model_cls, overrides = SPECS[name]
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        # Peaked logits: near-ties between the top two tokens would make greedy
        # equality depend on the last bit of a sum.
        model.model.norm.weight.mul_(8.0)
        if name == "qwen2":
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.1)
    return model


def save(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def edit_config(path: Path, **changes) -> None:
    file = path / "config.json"
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))
