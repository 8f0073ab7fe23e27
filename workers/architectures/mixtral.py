"""Mixtral: Mistral's attention, a mixture of experts on every layer.

``config.json``: ``hidden_act`` (silu), the rope (theta 1e6 by default),
``sliding_window`` on every layer when set, ``num_local_experts`` experts of
``intermediate_size``, ``num_experts_per_tok`` a token (softmax, top-k,
renormalised). Tensors: Llama's, the experts under ``block_sparse_moe``
(router ``gate``, each expert's ``w1``/``w3``/``w2``).
"""

from __future__ import annotations

from ..config import MOE, LayerSpec
from .base import Architecture, WeightNames
from .keys import Fields, Raw, activation, experts, rope, window


def parse_mixtral(raw: Raw, f: Fields) -> Fields:
    act = activation(raw)
    fields = rope(raw, default_theta=1000000.0)
    layer = LayerSpec(activation=act, window=window(raw), mlp=MOE)
    fields["experts"] = experts(raw, "num_local_experts", "intermediate_size", renormalize=True)
    return {**fields, "layers": (layer,) * f["num_layers"]}


MIXTRAL = Architecture(
    parse_mixtral,
    WeightNames(
        router="block_sparse_moe.gate",
        expert="block_sparse_moe.experts.{}.",
        expert_gate_up_down=("w1", "w3", "w2"),
    ),
)
