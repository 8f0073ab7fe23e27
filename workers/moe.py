"""A mixture-of-experts layer in place of the MLP (Mixtral, Qwen3-MoE).

The router is replicated; each expert is split across tensor-parallel ranks
like the dense MLP (gate/up rows by rank, down columns by rank), so every rank
computes every chosen expert on its slice and one all-reduce sums the slices.
Expert parallelism (whole experts per rank) is not implemented.

Weights are stacked per layer, ``w13 [num_experts, 2 * inter, hidden]`` (gate
rows, then up rows) and ``w2 [num_experts, hidden, inter]``, the layout the
Triton grouped kernel reads; the CPU computes each expert on the rows routed
to it (:func:`iterserve.kernels.experts.fused_experts`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..kernels.cpu.linear import PackedWeight, linear
from ..kernels.cpu.linear import pack as pack_weight
from ..kernels.experts import route
from .config import LayerSpec, ModelConfig
from .layers import AllReduce, TPLayout, weight


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec, tp: TPLayout, ops: Any,
                 all_reduce: AllReduce, **kw):  # fmt: skip
        super().__init__()
        experts = config.experts
        assert experts is not None  # ModelConfig checks a MOE layer has them
        self.ops, self.all_reduce = ops, all_reduce
        self.top_k = experts.top_k
        self.renormalize = experts.renormalize
        self.activation = spec.activation
        e, h, inter = experts.num_experts, config.hidden_size, tp.expert_intermediate
        self.router = weight(e, h, **kw)
        self.w13 = weight(e, 2 * inter, h, **kw)
        self.w2 = weight(e, h, inter, **kw)
        self.router_packed: PackedWeight | None = None
        self.packed: list[tuple[PackedWeight | None, PackedWeight | None]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear(x, self.router, None, self.router_packed)  # [num_tokens, num_experts]
        weights, ids = route(logits, self.top_k, self.renormalize)  # [num_tokens, top_k] each
        out = self.ops.fused_experts(x, self.w13, self.w2, ids, weights, self.activation,
                                     self.packed)  # fmt: skip
        return self.all_reduce(out)  # [num_tokens, hidden]

    def pack(self, pads_cliff, invariant: bool = False) -> None:
        self.router_packed = pack_weight(self.router, pads_cliff(self.router.shape), invariant)
        quantized = getattr(self.w13, "quantized", None)
        if quantized is not None:  # a quantized checkpoint's experts, packed at load
            self.packed = quantized
            return
        packed = [
            (
                pack_weight(w13, pads_cliff(w13.shape), invariant),
                pack_weight(w2, pads_cliff(w2.shape), invariant),
            )
            for w13, w2 in zip(self.w13, self.w2)
        ]
        self.packed = packed if packed and packed[0][0] is not None else None
