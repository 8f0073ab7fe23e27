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
    # Windows shorter than the tests' sequences (prompts up to 100, 32 tokens more).
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 32, "sliding_window": 24}),
    # Layer 0 full, layer 1 sliding; q/k norms; heads wider than hidden / heads.
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "head_dim": 32,
            "use_sliding_window": True,
            "sliding_window": 20,
            "max_window_layers": 1,
            "tie_word_embeddings": True,
        },
    ),
    # Eight experts, two a token, weights not renormalised; layer 1 a dense MLP.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # Sliding layer 0, full layer 1; scores capped at 2, logits at 30.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 20,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    # Local layers 0 and 2 (their own rope base), a global layer 1 with linear scaling.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 20,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    # Fused qkv and gate_up; longrope on 3/4 of each head; a window (Phi-3-mini's 2047).
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "sliding_window": 40,
            "max_position_embeddings": 1024,
            "original_max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
            },
        },
    ),
}
GEMMA = ("gemma2", "gemma3")  # norms stored as scale - 1, zero at initialisation


def short_context(name: str) -> dict[str, int]:
    """Runner keywords that serve checkpoint ``name`` within its original context when
    it has one: Phi-3's longrope then takes its short factors, as transformers does on
    the tests' sequences (all shorter than its 256 original positions). Served at its
    whole 1024 positions it would take the long ones (kernels/rope.py)."""
    return {"max_model_len": 256} if name == "phi3" else {}


def build_hf_model(name: str, seed: int = 0, **config_overrides):
    """Checkpoint ``name``'s transformers model; ``config_overrides`` change its config."""
    import transformers

    config_cls, model_cls, overrides = SPECS[name]
    config = getattr(transformers, config_cls)(**{**BASE, **overrides, **config_overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        if name in SPECS and name not in ("llama", "llama3", "qwen2", "mistral"):
            # Norm weights away from their initial value, so that a norm loaded into
            # the wrong place (or Gemma's offset forgotten) shows.
            for module_name, param in model.named_parameters():
                if "norm" in module_name:
                    param.add_(torch.randn_like(param) * 0.1)
        # Peaked logits: near-ties between the top two tokens would make greedy
        # equality depend on the last bit of a sum.
        if name in GEMMA:
            model.model.norm.weight.fill_(7.0)  # a scale of 8
        else:
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


class HFReference:
    """A transformers model plus memoised greedy generations."""

    def __init__(self, model):
        self.model = model
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids])).logits[0]  # [len(ids), vocab]

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int = 32) -> list[int]:
        key = (*prompt, -max_new_tokens)
        if key not in self._greedy:
            out = self.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
            )
            self._greedy[key] = out[0, len(prompt) :].tolist()
        return self._greedy[key]
