"""Rotary embedding and the KV store on CPU ranks, compiled with numba.

- :func:`rotary_embedding`: query and key rotated in one call, from the cached
  cos/sin rows, without the reference's broadcast intermediates (its broadcast
  multiplies alone cost a 2048-token prefill ~20 ms);
- :func:`store_kv`: each token's K/V row copied into its cache slot;
- :func:`rotary_store_kv`: the two in one call, the rotated key written straight
  into its slot (a layer's ops between its products each pay a dispatch and
  their own checks and allocations, ~3x what they cost warm after a product has
  streamed the layer's weights through the caches).

The rotation runs on loops (any head size, fp32 or bf16) or, for bf16 heads of a
multiple of 32 values, on vector tiles (:func:`.tiles.rotate_tile`, the
dispatch table's ``tiles``), which round as torch's separate fp32 ops do, so the
rotated query and key equal the reference's to the bit. Every position and slot
is checked before anything is written.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import checks, reference
from . import dispatch
from .fastmath import as_array, load_f32, store_f32
from .jit import compiled, jit
from .tiles import rotate_tile

TILED = frozenset({"tiled"})


def on_cpu(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.is_cpu


@jit()
def _rotate_head(x, t, h, cos_sin, p, out, row):
    """Head ``h`` of token ``t`` of ``x`` rotated to position ``p``, into head ``h``
    of ``out``'s row ``row``."""
    half = x.shape[2] // 2
    for j in range(half):
        c, s = cos_sin[p, j], cos_sin[p, half + j]
        x1, x2 = load_f32(x, (t, h, j)), load_f32(x, (t, h, half + j))
        store_f32(out, (row, h, j), x1 * c - x2 * s)
        store_f32(out, (row, h, half + j), x2 * c + x1 * s)


@jit()
def _rotate(x, positions, cos_sin, out):
    tokens, heads = x.shape[0], x.shape[1]
    for t in range(tokens):
        for h in range(heads):
            _rotate_head(x, t, h, cos_sin, positions[t], out, t)


@jit()
def _first_outside(values, limit):
    """The index of the first value outside ``[0, limit)``, or -1."""
    for i in range(values.shape[0]):
        if values[i] < 0 or values[i] >= limit:
            return i
    return -1


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference.rotary_embedding` without its broadcast intermediates."""
    if (
        not compiled(query, key, cos_sin_cache)
        or cos_sin_cache.dtype != torch.float32
        or not on_cpu(positions)
    ):
        return reference.rotary_embedding(positions, query, key, cos_sin_cache)
    checks.check_rotary_embedding(positions, query, key, cos_sin_cache)
    pos = positions.numpy()
    bad = _first_outside(pos, cos_sin_cache.shape[0])
    if bad >= 0:
        raise IndexError(
            f"positions[{bad}]={int(pos[bad])} is outside the cos/sin cache of "
            f"{cos_sin_cache.shape[0]} positions"
        )
    cos_sin = cos_sin_cache.numpy()
    q_out = torch.empty(query.shape, dtype=query.dtype)
    k_out = torch.empty(key.shape, dtype=key.dtype)
    _rotate(as_array(query), pos, cos_sin, as_array(q_out))
    _rotate(as_array(key), pos, cos_sin, as_array(k_out))
    return q_out, k_out


@jit()
def _first_bad_token(positions, num_positions, slots, num_slots):
    """The first token whose position is outside ``[0, num_positions)`` (its
    index) or whose slot is past the cache (``tokens + index``), or -1."""
    tokens = positions.shape[0]
    for t in range(tokens):
        if positions[t] < 0 or positions[t] >= num_positions:
            return t
        if slots[t] >= num_slots:
            return tokens + t
    return -1


@jit()
def rotate_store_loops(query, key, value, positions, cos_sin, q_out, k_slots, v_slots, slots):
    """:func:`_rotate` of the query into ``q_out`` and of the key into its cache
    slot, the value copied beside it; a negative slot is skipped. Every position
    and slot is checked before anything is written: returns -1, or the first bad
    token's index (``tokens + index`` for a slot past the cache)."""
    tokens, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    bad = _first_bad_token(positions, cos_sin.shape[0], slots, k_slots.shape[0])
    if bad >= 0:
        return bad
    for t in range(tokens):
        p = positions[t]
        for h in range(heads):
            _rotate_head(query, t, h, cos_sin, p, q_out, t)
        slot = slots[t]
        if slot < 0:
            continue
        for h in range(kv_heads):
            _rotate_head(key, t, h, cos_sin, p, k_slots, slot)
            for d in range(head_dim):
                v_slots[slot, h, d] = value[t, h, d]
    return -1


@jit()
def rotate_store_tiles(
    query, q_stride, key, k_stride, value, v_stride, positions, cos_sin, q_out, k_slots, v_slots,
    slots,
):  # fmt: skip
    """:func:`rotate_store_loops` for bf16 heads of a multiple of 32 values, each
    head one :func:`.cpu_tiles.rotate_tile`. ``query``, ``key`` and ``value`` are
    1-D bits spanning their rows, which start ``*_stride`` elements apart (the
    rows of one ``qkv`` product); ``q_out`` is ``[tokens, heads * head_dim]``,
    the caches' slots ``[slot, kv_heads * head_dim]``."""
    tokens, q_width = q_out.shape
    head_dim = cos_sin.shape[1]
    width = k_slots.shape[1]
    heads, kv_heads = q_width // head_dim, width // head_dim
    chunks = head_dim // 32
    q_out_flat, k_cache_flat = q_out.reshape(-1), k_slots.reshape(-1)
    bad = _first_bad_token(positions, cos_sin.shape[0], slots, k_slots.shape[0])
    if bad >= 0:
        return bad
    for t in range(tokens):
        at = positions[t] * head_dim
        for h in range(heads):
            rotate_tile(query, t * q_stride + h * head_dim, cos_sin, at, q_out_flat,
                        t * q_width + h * head_dim, chunks)  # fmt: skip
        slot = slots[t]
        if slot < 0:
            continue
        for h in range(kv_heads):
            rotate_tile(key, t * k_stride + h * head_dim, cos_sin, at, k_cache_flat,
                        slot * width + h * head_dim, chunks)  # fmt: skip
        row = t * v_stride
        for d in range(width):
            v_slots[slot, d] = value[row + d]
    return -1


def rows_span(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` ([tokens, heads, head_dim], each row's heads side by side) as a 1-D
    view from its first element to its last, and its row stride."""
    tokens, heads, head_dim = x.shape
    stride = x.stride(0)
    return x.as_strided(((tokens - 1) * stride + heads * head_dim,), (1,)), stride


def rotates_in_tiles(query, key, value, cos_sin_cache, head_dim) -> bool:
    """Whether :func:`rotate_store_tiles` takes these rows: the dispatch
    table's ``tiles`` for bf16 heads of a multiple of 32 values, each row's heads
    side by side, at least one row, a contiguous cos/sin table as wide as a head."""
    return (
        query.dtype == torch.bfloat16
        and head_dim % 32 == 0
        and dispatch.current().kernel("rotary", dispatch.BF16, TILED) == "tiles"
        and cos_sin_cache.shape[1] == head_dim
        and cos_sin_cache.is_contiguous()
        and query.shape[0] > 0
        and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (query, key, value))
    )


def rotary_store_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """:func:`reference.rotary_store_kv` in one call: the rotated key goes straight
    into its cache slot. A layer's ops between the matrix products each pay a
    dispatch and their own checks and allocations, and after a product has
    streamed the layer's weights through the caches these cost ~3x what they do
    warm; one call instead of two saves a set of them per layer."""
    if (
        not compiled(query, key, value, k_cache, v_cache, cos_sin_cache)
        or cos_sin_cache.dtype != torch.float32
        or len({query.dtype, key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}) > 1
        or not (on_cpu(positions) and on_cpu(slot_mapping))
    ):
        return reference.rotary_store_kv(positions, query, key, value, cos_sin_cache, k_cache,
                                         v_cache, slot_mapping)  # fmt: skip
    checks.check_rotary_embedding(positions, query, key, cos_sin_cache)
    checks.check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    _, _, num_kv_heads, head_dim = k_cache.shape
    pos, slots = positions.numpy(), slot_mapping.numpy()
    q_out = torch.empty(query.shape, dtype=query.dtype)
    if rotates_in_tiles(query, key, value, cos_sin_cache, head_dim):
        (q, q_stride), (k, k_stride), (v, v_stride) = map(rows_span, (query, key, value))
        bad = rotate_store_tiles(
            as_array(q), q_stride, as_array(k), k_stride, as_array(v), v_stride, pos,
            cos_sin_cache.numpy(), as_array(q_out.view(q_out.shape[0], -1)),
            as_array(k_cache.view(-1, num_kv_heads * head_dim)),
            as_array(v_cache.view(-1, num_kv_heads * head_dim)), slots,
        )  # fmt: skip
    else:
        bad = rotate_store_loops(
            as_array(query), as_array(key), as_array(value), pos, cos_sin_cache.numpy(),
            as_array(q_out), as_array(k_cache.view(-1, num_kv_heads, head_dim)),
            as_array(v_cache.view(-1, num_kv_heads, head_dim)), slots,
        )  # fmt: skip
    refuse_bad_token(bad, pos, slots, cos_sin_cache, k_cache)
    return q_out


def refuse_bad_token(bad: int, pos: np.ndarray, slots: np.ndarray, cos_sin_cache, k_cache):
    """Raises for what :func:`rotate_store_loops` found (``bad``, -1 for nothing):
    a position outside the rotary table, or a slot past the cache."""
    if bad >= pos.shape[0]:
        reference.check_largest_slot(int(slots[bad - pos.shape[0]]), k_cache)
    elif bad >= 0:
        raise IndexError(
            f"positions[{bad}]={int(pos[bad])} is outside the cos/sin cache of "
            f"{cos_sin_cache.shape[0]} positions"
        )


@jit()
def _store_rows(key, value, k_slots, v_slots, slots):
    heads, head_dim = key.shape[1], key.shape[2]
    for t in range(slots.shape[0]):
        s = slots[t]
        if s < 0:
            continue
        for h in range(heads):
            for d in range(head_dim):
                k_slots[s, h, d] = key[t, h, d]
                v_slots[s, h, d] = value[t, h, d]


@jit()
def _largest(values):
    top = -1
    for i in range(values.shape[0]):
        top = max(top, values[i])
    return top


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`reference.store_kv`, one row copy per token."""
    if (
        not compiled(key, value, k_cache, v_cache)
        or len({key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}) > 1
        or not on_cpu(slot_mapping)
    ):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    checks.check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    _, _, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.numpy()
    if slots.shape[0]:
        reference.check_largest_slot(int(_largest(slots)), k_cache)
    _store_rows(
        as_array(key), as_array(value),
        as_array(k_cache.view(-1, num_kv_heads, head_dim)),
        as_array(v_cache.view(-1, num_kv_heads, head_dim)),
        slots,
    )  # fmt: skip
