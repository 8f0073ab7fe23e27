"""Small random LoRA adapters saved by ``peft`` for the tests, and their references."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

# name -> (rank, alpha, target modules, rsLoRA)
ADAPTERS = {
    "qv8": (8, 16, ["q_proj", "v_proj"], False),
    "all16": (
        16,
        8,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        False,
    ),  # fmt: skip
    "mlp4": (4, 8, ["o_proj", "gate_proj", "down_proj"], True),
    "kup64": (64, 32, ["k_proj", "up_proj"], False),
}


def build_peft_model(base, name: str, seed: int = 1):
    """``base`` (a transformers model, left untouched) with adapter ``name``:
    random A and B (peft starts B at zero), large enough to change greedy tokens."""
    from peft import LoraConfig, get_peft_model

    rank, alpha, targets, rslora = ADAPTERS[name]
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                        use_rslora=rslora, init_lora_weights=False)  # fmt: skip
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_A" in param_name or "lora_B" in param_name:
                param.copy_(torch.randn_like(param) * (0.6 / param.shape[-1] ** 0.5))
    return model


def save_adapter(model, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    return path
