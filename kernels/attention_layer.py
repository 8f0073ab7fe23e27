"""One attention layer's work between its two products, bound at load.

A decoder layer's attention takes its qkv product's rows and hands the output
product its input: the heads split out, optionally each normalised (q/k norms),
rotated (on all of a head's values, or the first ``rope_dim``), the new keys and
values stored in the layer's paged cache, and every row attended. What it reads
every step besides the rows is fixed at load: its caches, its rotary table, its
norms, its scale, window and soft cap. :class:`AttentionLayer` binds those once
(``KernelOps.attention_layer(...)``, made when the KV cache is allocated) and is
called each step with the rows and the step's
:class:`~iterserve.kernels.metadata.AttentionMetadata`.

This class composes a backend's ops; a backend whose kernels want arrays made
from the layer's tensors makes them here, at bind time (the cpu backend's
:class:`~iterserve.kernels.cpu.layer.CpuAttentionLayer`).
"""

from __future__ import annotations

from typing import Any

import torch

from .metadata import AttentionMetadata


class AttentionLayer:
    def __init__(
        self,
        ops: Any,
        *,
        num_heads: int,
        num_kv_heads: int,
        scale: float,
        cos_sin: torch.Tensor,  # [positions, rope_dim], fp32
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        window: int | None = None,
        soft_cap: float | None = None,
        q_norm: torch.Tensor | None = None,  # [head_dim], each head normalised before rotary
        k_norm: torch.Tensor | None = None,
        eps: float = 1e-6,
    ):
        self.ops = ops
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = k_cache.shape[3]
        self.scale, self.window, self.soft_cap = scale, window, soft_cap
        self.cos_sin, self.k_cache, self.v_cache = cos_sin, k_cache, v_cache
        self.q_norm, self.k_norm, self.eps = q_norm, k_norm, eps
        self.rope_dim = cos_sin.shape[1]
        # The common layer (no q/k norms, rotary on whole heads) is one op.
        self.whole = q_norm is None and self.rope_dim == self.head_dim

    def __call__(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``qkv`` (``[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]``) in,
        ``[num_tokens, num_heads * head_dim]`` out."""
        if self.whole:
            return self.ops.rotary_store_attend(
                meta.positions, qkv, self.num_heads, self.num_kv_heads, self.cos_sin,
                self.k_cache, self.v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, self.scale, max_query_len=meta.max_query_len,
                max_seq_len=meta.max_seq_len, window=self.window, soft_cap=self.soft_cap,
            )  # fmt: skip
        q = self.rotate_store(qkv, meta)
        return self.attend(q, meta).reshape(qkv.shape[0], -1)

    def rotate_store(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The heads split, normalised, rotated and stored: the rotated query
        ``[num_tokens, num_heads, head_dim]``."""
        n, hd, ops = qkv.shape[0], self.head_dim, self.ops
        q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, hd)  # [num_tokens, num_heads, head_dim]
        k = k.reshape(n, self.num_kv_heads, hd)  # [num_tokens, num_kv_heads, head_dim]
        v = v.reshape(n, self.num_kv_heads, hd)
        if self.q_norm is not None:  # each head normalised on its own, before rotary
            q = ops.rms_norm(q.reshape(-1, hd), self.q_norm, self.eps).view(q.shape)
            k = ops.rms_norm(k.reshape(-1, hd), self.k_norm, self.eps).view(k.shape)
        if self.rope_dim == hd:
            return ops.rotary_store_kv(meta.positions, q, k, v, self.cos_sin, self.k_cache,
                                       self.v_cache, meta.slot_mapping)  # fmt: skip
        r = self.rope_dim  # rotary on the first rope_dim values of each head; the rest as is
        q_rot, k_rot = ops.rotary_embedding(meta.positions, q[..., :r], k[..., :r], self.cos_sin)
        q, k = torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)
        ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return q

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Every row of ``q`` attended over the cache: ``[num_tokens, num_heads, head_dim]``."""
        return self.ops.paged_attention(
            q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, self.scale, max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len, window=self.window, soft_cap=self.soft_cap,
        )  # fmt: skip
