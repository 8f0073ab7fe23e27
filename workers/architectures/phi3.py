"""Phi-3, Phi-3.5 and Phi-4-mini.

``config.json``: ``hidden_act`` (silu), ``partial_rotary_factor`` (Phi-4-mini
rotates 3/4 of each head; refused unless in (0, 1] and rotating an even width),
the rope with ``longrope`` also spelt ``su`` or ``yarn`` (as transformers' Phi-3
reads them), ``sliding_window`` on every layer (Phi-3-mini's 2047). Tensors:
Llama's, but q/k/v in one ``qkv_proj`` and gate/up in one ``gate_up_proj``.
"""

from __future__ import annotations

from ..config import LayerSpec
from .base import Architecture, WeightNames
from .keys import Fields, Raw, activation, refuse, rope, window


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
