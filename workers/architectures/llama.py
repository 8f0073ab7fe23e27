"""Llama 2 / 3 / 3.1 and Mistral: the pre-norm decoder the other families vary.

``config.json``: ``hidden_act`` (silu), the rope (``llama3`` scaling among the
types every family reads), ``attention_bias`` (q/k/v/o), ``mlp_bias``; Mistral's
``sliding_window`` on every layer. Tensors: transformers' Llama names, the
defaults of :class:`.base.WeightNames`.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import LayerSpec
from .base import Architecture
from .keys import Fields, Raw, activation, attention_bias, rope, window


def _layer(raw: Raw) -> LayerSpec:
    return LayerSpec(activation=activation(raw), **attention_bias(raw),
                     mlp_bias=bool(raw.get("mlp_bias", False)))  # fmt: skip


def parse_llama(raw: Raw, f: Fields) -> Fields:
    return {"layers": (_layer(raw),) * f["num_layers"], **rope(raw)}


def parse_mistral(raw: Raw, f: Fields) -> Fields:
    layer = replace(_layer(raw), window=window(raw))  # every layer slides
    return {"layers": (layer,) * f["num_layers"], **rope(raw)}


LLAMA = Architecture(parse_llama)
MISTRAL = Architecture(parse_mistral)
