"""Every supported architecture: one module per model family, one registry.

A family module says what is particular to its architectures: what each reads
from ``config.json`` and refuses (a parser over :mod:`.keys`' readers), the
per-layer spec it gives the shared decoder (:class:`..config.LayerSpec`: norm
placement, q/k norms, biases, windows, rope table, soft caps, MLP kind and
activation), and how its checkpoints name their tensors
(:class:`.base.WeightNames`). :data:`ARCHITECTURES` maps the name a checkpoint's
``config.json`` gives (its ``architectures[0]``) to the family's declaration.
Adding an architecture whose features the decoder has is one module (or one
more declaration in its family's) and one line here (docs/model-runtime.md).
"""

from __future__ import annotations

from typing import Any

from ..config import CheckpointError, ModelConfig
from . import gemma, llama, mixtral, phi3, qwen
from .base import Architecture, WeightNames
from .keys import check_longrope, common_fields

__all__ = ["ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "parse_config", "weight_names"]

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": llama.LLAMA,
    "MistralForCausalLM": llama.MISTRAL,
    "Qwen2ForCausalLM": qwen.QWEN2,
    "Qwen3ForCausalLM": qwen.QWEN3,
    "Qwen3MoeForCausalLM": qwen.QWEN3_MOE,
    "MixtralForCausalLM": mixtral.MIXTRAL,
    "Gemma2ForCausalLM": gemma.GEMMA2,
    "Gemma3ForCausalLM": gemma.GEMMA3,
    "Phi3ForCausalLM": phi3.PHI3,
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
