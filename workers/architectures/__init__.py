"""Every supported architecture, by the name a checkpoint's ``config.json`` gives
it (its ``architectures[0]``): what each reads from the config and refuses (a
parser over :mod:`.keys`' readers), the per-layer spec it gives the shared
decoder (:class:`..config.LayerSpec`), and how its checkpoints name their
tensors (:class:`.base.WeightNames`); :data:`ARCHITECTURES` maps the names to
them. The Llama, Qwen and Mixtral families have their own modules.
"""

from __future__ import annotations

from typing import Any

from ..config import SANDWICH, CheckpointError, LayerSpec, ModelConfig
from . import llama, mixtral, qwen
from .base import Architecture, WeightNames
from .keys import (
    FULL,
    SLIDING,
    Fields,
    Raw,
    activation,
    attention_bias,
    check_longrope,
    common_fields,
    get_float,
    get_int,
    layer_types,
    refuse,
    rope,
    rope_fields,
    slide,
    window,
)

__all__ = ["ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "parse_config", "weight_names"]


def _gemma(raw: Raw, f: Fields, *, attn_softcap: float | None, final_softcap: float | None,
           pattern: int, qk_norm: bool = False, local_rope: bool = False) -> Fields:  # fmt: skip
    """What Gemma 2 and 3 read alike; Gemma 3's local layers rotate with their
    own table when ``local_rope``."""
    key = "hidden_activation" if "hidden_activation" in raw else "hidden_act"
    act = activation(raw, key, {"gelu_pytorch_tanh": "gelu_tanh"}, "gelu_pytorch_tanh")
    if raw.get("use_bidirectional_attention"):
        raise refuse("use_bidirectional_attention", True, "only causal attention is supported")
    layer = LayerSpec(norms=SANDWICH, qk_norm=qk_norm, activation=act, **attention_bias(raw),
                      soft_cap=_cap(raw, "attn_logit_softcapping", attn_softcap))  # fmt: skip
    fields: Fields = {
        "scale_embeddings": True,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "attn_scale_dim": get_float(raw, "query_pre_attn_scalar", 256),
        "final_softcap": _cap(raw, "final_logit_softcapping", final_softcap),
    }
    size = window(raw) if "sliding_window" in raw else 4096
    types = layer_types(raw, f["num_layers"], lambda i: SLIDING if (i + 1) % pattern else FULL)
    fields["layers"] = slide(layer, types, size, local_rope=local_rope)
    return fields


def _cap(raw: Raw, key: str, default: float | None) -> float | None:
    """A soft-cap: the config's (null: none), else the architecture's default."""
    value = raw.get(key, default)
    return None if value is None else get_float({key: value}, key, None)


def parse_gemma2(raw: Raw, f: Fields) -> Fields:
    fields = _gemma(raw, f, attn_softcap=50.0, final_softcap=30.0, pattern=2)
    return {**fields, **rope(raw)}


def parse_gemma3(raw: Raw, f: Fields) -> Fields:
    if raw.get("attn_logit_softcapping") is not None:
        raise refuse("attn_logit_softcapping", raw["attn_logit_softcapping"],
                     "Gemma 3 attention is not soft-capped")  # fmt: skip
    pattern = get_int(raw, "sliding_window_pattern", default=6)
    fields = _gemma(raw, f, attn_softcap=None, final_softcap=None, pattern=pattern,
                    qk_norm=True, local_rope=True)  # fmt: skip
    params: Any = raw.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:  # one entry per layer type
        fields.update(rope(raw, params=params[FULL] or {}, default_theta=1000000.0))
        local = params.get(SLIDING) or {}
        fields["local_rope_theta"], fields["local_rope_scaling"] = rope_fields(raw, params=local)
    else:  # the older spelling: the scaling is the global layers'
        fields.update(rope(raw, default_theta=1000000.0))
        fields["local_rope_theta"] = get_float(raw, "rope_local_base_freq", 10000.0)
    return fields


GEMMA2 = Architecture(parse_gemma2, WeightNames(norm_offset=1.0))
GEMMA3 = Architecture(parse_gemma3, WeightNames(norm_offset=1.0))


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
    "Gemma2ForCausalLM": GEMMA2,
    "Gemma3ForCausalLM": GEMMA3,
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
