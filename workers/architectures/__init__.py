"""Every supported architecture, by the name a checkpoint's ``config.json`` gives
it (its ``architectures[0]``): what each reads from the config and refuses (a
parser over :mod:`.keys`' readers), the per-layer spec it gives the shared
decoder (:class:`..config.LayerSpec`), and how its checkpoints name their
tensors (:class:`.base.WeightNames`); :data:`ARCHITECTURES` maps the names to
them. The Llama, Qwen, Mixtral and Gemma families have their own modules.
"""

from __future__ import annotations

from typing import Any

from ..config import CheckpointError, LayerSpec, ModelConfig
from . import gemma, llama, mixtral, qwen
from .base import Architecture, WeightNames
from .keys import (
    Fields,
    Raw,
    activation,
    check_longrope,
    common_fields,
    refuse,
    rope,
    window,
)

__all__ = ["ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "parse_config", "weight_names"]


def parse_phi3(raw: Raw, f: Fields) -> Fields:
    act = activation(raw)
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):
        params["rope_type"] = "longrope"  # transformers' Phi-3 reads both as longrope
        params.pop("type", None)
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise refuse("partial_rotary_factor", partial, "it must be in (0, 1]")
    rotary = int(f["head_dim"] * partial)
    if rotary % 2:
        raise refuse("partial_rotary_factor", partial, f"it rotates {rotary} (odd) dimensions")
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    return {
        "rotary_dim": rotary if rotary != f["head_dim"] else None,
        **rope(raw, params={"rope_theta": theta, **params}),
        "layers": (LayerSpec(activation=act, window=window(raw)),) * f["num_layers"],  # all slide
    }


PHI3 = Architecture(
    parse_phi3, WeightNames(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",))
)


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": llama.LLAMA,
    "MistralForCausalLM": llama.MISTRAL,
    "Qwen2ForCausalLM": qwen.QWEN2,
    "Qwen3ForCausalLM": qwen.QWEN3,
    "Qwen3MoeForCausalLM": qwen.QWEN3_MOE,
    "MixtralForCausalLM": mixtral.MIXTRAL,
    "Gemma2ForCausalLM": gemma.GEMMA2,
    "Gemma3ForCausalLM": gemma.GEMMA3,
    "Phi3ForCausalLM": PHI3,
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """``config.json`` read by its architecture's parser, checked once."""
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise CheckpointError("config.json: 'architectures' is missing or not a non-empty list")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"config.json: unsupported architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    fields = common_fields(raw)
    fields.update(ARCHITECTURES[arch].parse(raw, fields))
    num_layers = fields.pop("num_layers")  # the parser's to read; the config's is len(layers)
    assert len(fields["layers"]) == num_layers, f"{arch}: one LayerSpec per layer"
    config = ModelConfig(**fields)
    for scaling in (config.rope_scaling, config.local_rope_scaling):
        check_longrope(scaling, config.rope_dim, config.max_position_embeddings)
    return config


def weight_names(config: ModelConfig) -> WeightNames:
    """How ``config``'s checkpoints name their tensors."""
    return ARCHITECTURES[config.architecture].weights
