"""The layers the decoder is made of: attention over the paged cache and the
dense gated MLP, each split across tensor-parallel ranks (see :mod:`.model`),
and what every layer shares: this rank's slice of the model (:class:`TPLayout`).
How the flat batch splits into sequences is the step's
:class:`~iterserve.kernels.AttentionMetadata`, handed to every layer.

Every matrix product goes through :func:`iterserve.kernels.cpu.linear.linear`
with the weight's packed copy when there is one (``pack_weights``). Each
attention layer's work between its two products is a kernel bound to the
layer's KV cache and rotary table when the cache is allocated (:meth:`Attention.bind`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..kernels import AttentionMetadata
from ..kernels.attention_layer import AttentionLayer
from ..kernels.cpu.linear import PackedWeight, linear
from ..kernels.cpu.linear import pack as pack_weight
from .config import LayerSpec, ModelConfig

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def weight(*shape: int, dtype: torch.dtype, device: Any) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class TPLayout:
    """Which heads / MLP columns / expert columns this rank owns."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int):
        expert_intermediate = config.experts.intermediate_size if config.experts else 0
        for what, n in (
            ("num_attention_heads", config.num_heads),
            ("num_key_value_heads", config.num_kv_heads),
            ("intermediate_size", config.intermediate_size),
            ("moe_intermediate_size", expert_intermediate),
        ):
            if n % tp_size:
                raise ValueError(f"tp_size {tp_size} does not divide {what} {n}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        self.rank, self.size = tp_rank, tp_size
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.intermediate = config.intermediate_size // tp_size
        self.expert_intermediate = expert_intermediate // tp_size
        self.head_dim = config.head_dim

    def rows(self, per_rank: int) -> tuple[int, int]:
        return self.rank * per_rank, (self.rank + 1) * per_rank


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec, tp: TPLayout, ops: Any,
                 all_reduce: AllReduce, **kw):  # fmt: skip
        super().__init__()
        self.tp, self.ops, self.all_reduce = tp, ops, all_reduce
        hd = config.head_dim
        self.q_size = tp.num_heads * hd
        self.kv_size = tp.num_kv_heads * hd
        self.scale = config.attn_scale
        self.window = spec.window
        self.soft_cap = spec.soft_cap
        self.rope_dim = config.rope_dim
        self.eps = config.rms_norm_eps
        self.local_rope = spec.local_rope  # rotates with the model's second table
        # q, k and v stacked so one matmul produces all three.
        self.qkv_weight = weight(self.q_size + 2 * self.kv_size, config.hidden_size, **kw)
        self.qkv_bias = weight(self.q_size + 2 * self.kv_size, **kw) if spec.qkv_bias else None
        self.o_weight = weight(config.hidden_size, self.q_size, **kw)
        self.o_bias = weight(config.hidden_size, **kw) if spec.o_bias else None
        self.q_norm = weight(hd, **kw) if spec.qk_norm else None
        self.k_norm = weight(hd, **kw) if spec.qk_norm else None
        # The same weights laid out for the CPU kernels, once loaded (pack_weights).
        self.qkv_packed: PackedWeight | None = None
        self.o_packed: PackedWeight | None = None
        # The work between the two products, bound to the layer's cache (bind).
        self.kernel: AttentionLayer | None = None
        # Adds the step's LoRA deltas to a product (Decoder.enable_lora); None: none.
        self.lora: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def bind(self, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Binds the layer to its rotary table (``[positions, rope_dim]``, fp32) and KV
        cache (``[num_blocks + 1, block_size, num_kv_heads, head_dim]`` each): the
        backend's kernel for the work between the two products."""
        self.kernel = self.ops.attention_layer(
            self.ops, num_heads=self.tp.num_heads, num_kv_heads=self.tp.num_kv_heads,
            scale=self.scale, cos_sin=cos_sin, k_cache=k_cache, v_cache=v_cache,
            window=self.window, soft_cap=self.soft_cap, q_norm=self.q_norm, k_norm=self.k_norm,
            eps=self.eps,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """``x``: ``[num_tokens, hidden]``; returns ``[num_tokens, hidden]``."""
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed)  # [num_tokens, q + 2 kv]
        if self.lora is not None:
            self.lora("qkv", x, qkv)
        out = self.kernel(qkv, attn)  # [num_tokens, q_size]
        o = linear(
            out, self.o_weight, None, self.o_packed
        )  # [num_tokens, hidden], this rank's part
        if self.lora is not None:  # a partial sum too: the all-reduce adds the ranks' deltas
            self.lora("o", out, o)
        out = self.all_reduce(o)
        if self.o_bias is not None:
            # Added once, after the reduction, not once per rank.
            out = out + self.o_bias
        return out  # [num_tokens, hidden]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec, tp: TPLayout, ops: Any,
                 all_reduce: AllReduce, **kw):  # fmt: skip
        super().__init__()
        self.ops, self.all_reduce = ops, all_reduce
        self.act = activation_op(spec.activation)
        inter = tp.intermediate
        # gate rows first, then up rows: the layout silu_mul expects.
        self.gate_up_weight = weight(2 * inter, config.hidden_size, **kw)
        self.gate_up_bias = weight(2 * inter, **kw) if spec.mlp_bias else None
        self.down_weight = weight(config.hidden_size, inter, **kw)
        self.down_bias = weight(config.hidden_size, **kw) if spec.mlp_bias else None
        self.gate_up_packed: PackedWeight | None = None
        self.down_packed: PackedWeight | None = None
        self.lora: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_packed)
        if self.lora is not None:
            self.lora("gate_up", x, h)
        h = getattr(self.ops, self.act)(h)  # [num_tokens, inter]
        down = linear(h, self.down_weight, None, self.down_packed)
        if self.lora is not None:
            self.lora("down", h, down)
        out = self.all_reduce(down)
        if self.down_bias is not None:
            out = out + self.down_bias
        return out

    def pack(self, pads_cliff: Callable[[torch.Size], bool], invariant: bool = False) -> None:
        self.gate_up_packed = pack_weight(
            self.gate_up_weight, pads_cliff(self.gate_up_weight.shape), invariant
        )
        self.down_packed = pack_weight(
            self.down_weight, pads_cliff(self.down_weight.shape), invariant
        )


def activation_op(activation: str) -> str:
    """The kernel op of a gated ``activation`` (:class:`LayerSpec`'s)."""
    return {"silu": "silu_mul", "gelu_tanh": "gelu_tanh_mul"}[activation]
