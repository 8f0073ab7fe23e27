"""Qwen2, Qwen3 and Qwen3-MoE.

``config.json``: ``hidden_act`` (silu), the rope; Qwen2's q/k/v biases (always,
none on o_proj), Qwen3's ``attention_bias`` and q/k norms. Windows only with
``use_sliding_window``: on the layers from ``max_window_layers`` on (or as
``layer_types`` says) for Qwen2/3, on every layer for Qwen3-MoE, as transformers
does. Qwen3-MoE's experts (``num_experts`` or ``num_local_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``) on the
layers ``decoder_sparse_step`` picks, less ``mlp_only_layers``; refused:
``shared_expert_intermediate_size`` (Qwen2-MoE's shared expert). Tensors:
Llama's names; the experts' ``mlp.gate`` and ``mlp.experts.j.{gate,up,down}_proj``
are the defaults too.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import DENSE, MOE, LayerSpec
from .base import Architecture
from .keys import (
    FULL,
    SLIDING,
    Fields,
    Raw,
    activation,
    attention_bias,
    experts,
    get_int,
    layer_types,
    refuse,
    rope,
    slide,
    window,
)


def _windows(raw: Raw, f: Fields, layer: LayerSpec) -> tuple[LayerSpec, ...]:
    if not raw.get("use_sliding_window", False):
        return (layer,) * f["num_layers"]
    size = window(raw)
    first = raw.get("max_window_layers", 28)
    types = layer_types(raw, f["num_layers"], lambda i: SLIDING if i >= first else FULL)
    return slide(layer, types, size)


def parse_qwen2(raw: Raw, f: Fields) -> Fields:
    layer = LayerSpec(activation=activation(raw), qkv_bias=True)
    return {**rope(raw), "layers": _windows(raw, f, layer)}


def parse_qwen3(raw: Raw, f: Fields) -> Fields:
    layer = LayerSpec(activation=activation(raw), **attention_bias(raw), qk_norm=True)
    return {**rope(raw), "layers": _windows(raw, f, layer)}


def parse_qwen3_moe(raw: Raw, f: Fields) -> Fields:
    layer = LayerSpec(activation=activation(raw), **attention_bias(raw), qk_norm=True)
    fields = rope(raw)
    if raw.get("use_sliding_window", False):
        layer = replace(layer, window=window(raw))  # transformers slides every layer then
    fields["experts"] = experts(raw, "num_experts" if "num_experts" in raw else "num_local_experts",
                                "moe_intermediate_size",
                                renormalize=bool(raw.get("norm_topk_prob", False)))  # fmt: skip
    if raw.get("shared_expert_intermediate_size"):
        raise refuse("shared_expert_intermediate_size", raw["shared_expert_intermediate_size"],
                     "shared experts are not supported")  # fmt: skip
    step = get_int(raw, "decoder_sparse_step", default=1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise refuse("mlp_only_layers", only, "it must be a list of layer indices")
    dense = [i in only or (i + 1) % step != 0 for i in range(f["num_layers"])]
    fields["layers"] = tuple(replace(layer, mlp=DENSE if d else MOE) for d in dense)
    return fields


QWEN2 = Architecture(parse_qwen2)
QWEN3 = Architecture(parse_qwen3)
QWEN3_MOE = Architecture(parse_qwen3_moe)
