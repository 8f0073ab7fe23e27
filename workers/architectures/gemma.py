"""Gemma 2 and Gemma 3 (text).

``config.json``: ``hidden_activation`` (or ``hidden_act``; ``gelu_pytorch_tanh``
only), ``attention_bias``, ``query_pre_attn_scalar`` (the scores' scale, default
256), ``tie_word_embeddings`` (default true), the soft caps
``attn_logit_softcapping`` and ``final_logit_softcapping`` (Gemma 2: 50 and 30
when absent, null for none), ``sliding_window`` (default 4096) on the layers
``layer_types`` names, else every other one (Gemma 2) or five in six (Gemma 3,
``sliding_window_pattern``). Gemma 3 adds q/k norms and a rope of the local
layers' own (``rope_local_base_freq``, or ``rope_parameters.sliding_attention``).
Refused: ``use_bidirectional_attention``; on Gemma 3, ``attn_logit_softcapping``
(transformers reads it but never applies it: there is no reference to match).

Every layer has sandwich norms; embeddings are scaled by ``sqrt(hidden_size)``.
Tensors: Llama's names (the sandwich norms' ``pre_/post_feedforward_layernorm``
among the defaults), each norm stored as ``scale - 1``.
"""

from __future__ import annotations

from typing import Any

from ..config import SANDWICH, LayerSpec
from .base import Architecture, WeightNames
from .keys import (
    FULL,
    SLIDING,
    Fields,
    Raw,
    activation,
    attention_bias,
    get_float,
    get_int,
    layer_types,
    refuse,
    rope,
    rope_fields,
    slide,
    window,
)


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
