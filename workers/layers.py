"""The layers the decoder is made of: attention over the paged cache and the
dense gated MLP, each split across tensor-parallel ranks (see :mod:`.model`),
and what every layer shares: this rank's slice of the model (:class:`TPLayout`)
and how the flat batch splits into sequences (:class:`AttentionInputs`).

Every matrix product goes through :func:`iterserve.kernels.cpu.linear.linear`
with the weight's packed copy when there is one (``Decoder.pack_weights``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..kernels.cpu.linear import linear
from ..kernels.cpu.linear import pack as pack_weight
from .config import LayerSpec, ModelConfig

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass
class AttentionInputs:
    """How the flat batch splits into sequences, for ``store_kv``/``paged_attention``."""

    slot_mapping: torch.Tensor  # [num_tokens], block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs], KV length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    # Host-side bounds the attention kernels choose their launches by (no sync):
    # the longest query piece and the longest sequence; None = infer from shapes.
    max_query_len: int | None = None
    max_seq_len: int | None = None


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
        # The same weights laid out for oneDNN, once loaded (Decoder.pack_weights).
        self.qkv_packed: torch.Tensor | None = None
        self.o_packed: torch.Tensor | None = None
        # Adds the step's LoRA deltas to a product (Decoder.enable_lora); None: none.
        self.lora: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        cos_sin: torch.Tensor,  # [max_pos, rope_dim]
        attn: AttentionInputs,
        k_cache: torch.Tensor,  # [num_blocks + 1, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed)  # [num_tokens, q + 2 kv]
        if self.lora is not None:
            self.lora("qkv", x, qkv)
        if self.q_norm is None and self.rope_dim == self.tp.head_dim:  # the common case, in one op
            out = self.ops.rotary_store_attend(
                positions, qkv, self.tp.num_heads, self.tp.num_kv_heads, cos_sin, k_cache, v_cache,
                attn.slot_mapping, attn.block_tables, attn.seq_lens, attn.query_start_loc,
                self.scale, max_query_len=attn.max_query_len, max_seq_len=attn.max_seq_len,
                window=self.window, soft_cap=self.soft_cap,
            )  # fmt: skip
        else:
            out = self._attend_heads(qkv, positions, cos_sin, attn, k_cache, v_cache)
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

    def _attend_heads(self, qkv, positions, cos_sin, attn, k_cache, v_cache) -> torch.Tensor:
        """:meth:`forward`'s attention for heads normalised before rotary, or
        rotated on part of their values: ``[num_tokens, q_size]``."""
        n, hd = qkv.shape[0], self.tp.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.tp.num_heads, hd)  # [num_tokens, num_heads, head_dim]
        k = k.reshape(n, self.tp.num_kv_heads, hd)  # [num_tokens, num_kv_heads, head_dim]
        v = v.reshape(n, self.tp.num_kv_heads, hd)
        if self.q_norm is not None:  # each head normalised on its own, before rotary
            q = self.ops.rms_norm(q.reshape(-1, hd), self.q_norm, self.eps).view(q.shape)
            k = self.ops.rms_norm(k.reshape(-1, hd), self.k_norm, self.eps).view(k.shape)
        if self.rope_dim == hd:
            q = self.ops.rotary_store_kv(positions, q, k, v, cos_sin, k_cache, v_cache,
                                         attn.slot_mapping)  # fmt: skip
        else:
            q, k = self._rotate(positions, q, k, cos_sin)
            self.ops.store_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        out = self.ops.paged_attention(
            q,
            k_cache,
            v_cache,
            attn.block_tables,
            attn.seq_lens,
            attn.query_start_loc,
            self.scale,
            max_query_len=attn.max_query_len,
            max_seq_len=attn.max_seq_len,
            window=self.window,
            soft_cap=self.soft_cap,
        )  # [num_tokens, num_heads, head_dim]
        return out.reshape(n, self.q_size)

    def _rotate(self, positions, q, k, cos_sin):
        """Rotary on the first ``rope_dim`` of each head; the rest passes through."""
        r = self.rope_dim
        if r == q.shape[-1]:
            return self.ops.rotary_embedding(positions, q, k, cos_sin)
        q_rot, k_rot = self.ops.rotary_embedding(positions, q[..., :r], k[..., :r], cos_sin)
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)


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
        self.gate_up_packed: torch.Tensor | None = None
        self.down_packed: torch.Tensor | None = None
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

    def pack(self) -> None:
        self.gate_up_packed = pack_weight(self.gate_up_weight)
        self.down_packed = pack_weight(self.down_weight)


def activation_op(activation: str) -> str:
    """The kernel op of a gated ``activation`` (:class:`LayerSpec`'s)."""
    return {"silu": "silu_mul", "gelu_tanh": "gelu_tanh_mul"}[activation]
