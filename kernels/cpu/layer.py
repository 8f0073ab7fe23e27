"""An attention layer on CPU ranks: its arrays made at load, its step in one call.

After each matrix product has streamed a layer's weights through the caches,
every op between two products costs ~50–80 µs beyond its kernel (docs/kernels.md:
cold dispatch, checks, allocations, views). So the layer's attention is one
compiled call where it can be: the heads of the qkv product's rows rotated, the
new keys and values stored, every row attended (:func:`_one_call_tiles`,
:func:`_one_call_loops`). That applies to a step of decode rows and short prefill
pieces only (a long piece has kernels of its own), on one thread, for layers
without q/k norms that rotate whole heads. Anything else is the rotation and
store, then :func:`.attention.attend`.

What the kernels read of the layer's own tensors (its caches as arrays, its
rotary table) is made once, when the layer is bound to its cache
(:class:`CpuAttentionLayer`); what they read of the step comes from the step's
plan (:mod:`.plan`), built once a step.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import checks, reference
from ..attention_layer import AttentionLayer
from ..metadata import AttentionMetadata
from . import attention, dispatch, plan, rotary
from .attention_rows import attend_rows
from .fastmath import as_array
from .jit import compiled, jit


@jit()
def _one_call_tiles(
    qkv, q_width, kv_width, positions, cos_sin, q_out, k_slots, v_slots, slots, k_cache, v_cache,
    tables, table_of, starts, lengths, rows, scale, soft_cap, out, amx,
):  # fmt: skip
    """:func:`.rotary.rotate_store_tiles` of a product's ``qkv`` rows (the query's
    ``q_width`` values, then the key's and the value's ``kv_width``), then every row
    attended by the tiles into ``out``. Returns what the first returns: -1, or the
    bad token that stopped it before anything was written."""
    stride = qkv.shape[1]
    flat = qkv.reshape(-1)
    bad = rotary.rotate_store_tiles(flat, stride, flat[q_width:], stride, flat[q_width + kv_width:],
                                    stride, positions, cos_sin, q_out.reshape(q_out.shape[0], -1),
                                    k_slots, v_slots, slots)  # fmt: skip
    if bad < 0:
        attend_rows(q_out, k_cache, v_cache, tables, table_of, starts, lengths, rows, scale,
                    soft_cap, out, True, amx)  # fmt: skip
    return bad


@jit()
def _one_call_loops(
    query, key, value, positions, cos_sin, q_out, k_slots, v_slots, slots, k_cache, v_cache,
    tables, table_of, starts, lengths, rows, scale, soft_cap, out,
):  # fmt: skip
    """:func:`_one_call_tiles` on the loops (any head size, fp32 or bf16)."""
    bad = rotary.rotate_store_loops(query, key, value, positions, cos_sin, q_out, k_slots,
                                    v_slots, slots)  # fmt: skip
    if bad < 0:
        attend_rows(q_out, k_cache, v_cache, tables, table_of, starts, lengths, rows, scale,
                    soft_cap, out, None, None)  # fmt: skip
    return bad


class CpuAttentionLayer(AttentionLayer):
    """:class:`~iterserve.kernels.attention_layer.AttentionLayer` on the compiled
    kernels, which take fp32 or bf16 caches and an fp32 rotary table; the reference
    ops where they do not (fp16)."""

    def __init__(self, ops, **kw):
        super().__init__(ops, **kw)
        checks.check_attention_options(self.scale, self.window, self.soft_cap)
        k, v, table = self.k_cache, self.v_cache, self.cos_sin
        self.compiled = (
            compiled(k, v, table) and k.dtype == v.dtype and table.dtype == torch.float32
            and k.is_contiguous() and v.is_contiguous() and table.is_contiguous()
            and k.shape == v.shape and self.num_heads % self.num_kv_heads == 0
        )  # fmt: skip
        if not self.compiled:
            return
        _, block_size, num_kv_heads, head_dim = k.shape
        self.dtype_name = attention.DTYPE_NAMES[k.dtype]
        # [blocks, block_size, kv_heads, head_dim], and its slots as rows and as heads
        self.k_arrays, self.v_arrays = self._cache_arrays(k), self._cache_arrays(v)
        self.table = table.numpy()
        self.rows_kernel = dispatch.current().kernel(
            "attention.rows", self.dtype_name,
            dispatch.row_traits(self.num_heads, num_kv_heads, head_dim, block_size),
        )  # fmt: skip
        rotary_tiles = k.dtype == torch.bfloat16 and head_dim % 32 == 0 and (
            dispatch.current().kernel("rotary", self.dtype_name, rotary.TILED) == "tiles"
        )  # fmt: skip
        # The one call: the tiles' rotation with the tiles' attention, or both on loops.
        self.one_call = self.whole and (
            (self.rows_kernel == "loops") or (self.rows_kernel != "loops" and rotary_tiles)
        )

    @staticmethod
    def _cache_arrays(cache: torch.Tensor) -> tuple:
        array = as_array(cache)
        slots = array.reshape(-1, cache.shape[2], cache.shape[3])
        return array, slots.reshape(slots.shape[0], -1), slots

    def _plan(self, n: int, meta: AttentionMetadata) -> plan.BatchPlan:
        """The step's plan, or one built now (a call outside a step)."""
        host, invariant = meta.host, self.ops.invariant
        if isinstance(host, plan.BatchPlan) and host.matches(
            n, self.num_heads, self.k_cache.shape[1], invariant
        ):
            return host
        built = plan.build(n, self.num_heads, self.k_cache.shape[1], meta.block_tables,
                           meta.seq_lens, meta.query_start_loc, meta.positions,
                           meta.slot_mapping, invariant=invariant)  # fmt: skip
        meta.host = built  # the next layer of this step reads it too
        return built

    def __call__(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = qkv.shape[0]
        if not self.compiled or not compiled(qkv) or qkv.dtype != self.k_cache.dtype:
            return super().attend(self._rotate_store(qkv, meta), meta).reshape(n, -1)
        batch = self._plan(n, meta)
        if (
            self.one_call and n > 0 and batch.rows is not None and not batch.pieces.long
            and batch.positions is not None and batch.slots is not None
            and qkv.dim() == 2 and qkv.is_contiguous() and torch.get_num_threads() == 1
            and qkv.shape[1] == (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        ):  # fmt: skip
            return self._one_call(qkv, batch)
        return self._attend(self._rotate_store(qkv, meta), batch).view(n, -1)

    def _rotate_store(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not self.whole:
            return self.rotate_store(qkv, meta)
        q, k, v = reference.split_qkv(qkv, self.num_heads, self.num_kv_heads, self.k_cache)
        return self.ops.rotary_store_kv(meta.positions, q, k, v, self.cos_sin, self.k_cache,
                                        self.v_cache, meta.slot_mapping)  # fmt: skip

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not self.compiled or not compiled(q) or q.dtype != self.k_cache.dtype:
            return super().attend(q, meta)
        return self._attend(q, self._plan(q.shape[0], meta))

    def _attend(self, q: torch.Tensor, batch: plan.BatchPlan) -> torch.Tensor:
        checks.check_attention_call(q, self.k_cache, self.v_cache, self.scale)
        out = torch.empty(q.shape, dtype=q.dtype)  # [num_tokens, num_heads, head_dim]
        attention.attend(
            q, self.k_cache, self.v_cache, batch, self.scale, self.window, self.soft_cap, out
        )
        return out

    def _one_call(self, qkv: torch.Tensor, batch: plan.BatchPlan) -> torch.Tensor:
        n, hd = qkv.shape[0], self.head_dim
        tables, table_of, lengths, rows = batch.rows
        starts = batch.row_starts(self.window)
        soft_cap = None if self.soft_cap is None else np.float32(self.soft_cap)
        q_out = torch.empty((n, self.num_heads, hd), dtype=qkv.dtype)
        out = torch.empty((n, self.num_heads, hd), dtype=qkv.dtype)
        k, v = self.k_arrays, self.v_arrays
        if self.rows_kernel == "loops":
            q, key, value = reference.split_qkv(
                qkv, self.num_heads, self.num_kv_heads, self.k_cache
            )
            bad = _one_call_loops(
                as_array(q), as_array(key), as_array(value), batch.positions, self.table,
                as_array(q_out), k[2], v[2], batch.slots, k[0], v[0], tables, table_of, starts,
                lengths, rows, np.float32(self.scale), soft_cap, as_array(out),
            )  # fmt: skip
        else:
            bad = _one_call_tiles(
                as_array(qkv), self.num_heads * hd, self.num_kv_heads * hd, batch.positions,
                self.table, as_array(q_out), k[1], v[1], batch.slots, k[0], v[0], tables,
                table_of, starts, lengths, rows, np.float32(self.scale), soft_cap, as_array(out),
                True if self.rows_kernel == "amx_tiles" else None,
            )  # fmt: skip
        rotary.refuse_bad_token(bad, batch.positions, batch.slots, self.cos_sin, self.k_cache)
        return out.view(n, self.num_heads * hd)


def rotary_store_attend(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    plan: plan.BatchPlan | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """:func:`reference.rotary_store_attend` as a :class:`CpuAttentionLayer` bound
    for this one call (a model binds its layers once, at load); ``invariant``: a
    batch-invariant engine's (:mod:`.plan`)."""
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        checks.check_tensor("k_cache", k_cache, ndim=4)
    reference.split_qkv(qkv, num_heads, num_kv_heads, k_cache)  # names a bad qkv or head count
    if not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dim() != 2:
        checks.check_tensor("cos_sin_cache", cos_sin_cache, ndim=2)
    from ..registry import get_ops  # the registry imports this module

    layer = CpuAttentionLayer(
        get_ops("cpu", invariant=invariant), num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale, cos_sin=cos_sin_cache,
        k_cache=k_cache, v_cache=v_cache, window=window, soft_cap=soft_cap,
    )  # fmt: skip
    meta = AttentionMetadata(positions, slot_mapping, block_tables, seq_lens, query_start_loc,
                             max_query_len, max_seq_len, plan)  # fmt: skip
    if layer.compiled and plan is None:
        checks.check_paged_attention(qkv.new_empty(0, num_heads, k_cache.shape[3]), k_cache,
                                     v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     window, soft_cap)  # fmt: skip
    return layer(qkv, meta)
