"""The elementwise serving ops for CPU ranks, compiled with numba.

Each reference op is a handful of whole-tensor torch operations, and on a CPU
each of those is a pass over memory plus a dispatch of its own: a decode step
of 128 rows spends more time between the matrix products than in attention,
and the rotary embedding's broadcast multiplies alone cost a 2048-token prefill
~20 ms. These kernels do each op in one pass, row by row:

- :func:`rms_norm`: the residual add, the mean square and the scaling together;
- :func:`rotary_embedding`: query and key rotated in one call, from the cached
  cos/sin rows, without the broadcast intermediates;
- :func:`store_kv`: each token's K/V row copied into its cache slot;
- :func:`rotary_store_kv`: the two above in one call, the rotated key written
  straight into its slot.

- :func:`silu_mul`: a gated MLP's SiLU·mul in one pass over each bf16 row
  (:func:`.cpu_tiles.silu_mul_tile`); fp32 takes torch's ops
  (:func:`.reference.silu_mul_in_dtype`), whose vectorized exponential beats a
  compiled scalar loop.
- ``gelu_tanh_mul`` is torch's, in the tensors' dtype.

Every kernel serves fp32 and bf16 tensors alike (:mod:`.cpu_math`: a bf16
tensor is read as fp32 and rounded where the reference rounds, so the two
agree to the last bit but for the order of sums). numba has no fp16, so fp16
and other devices take the reference path. Compiled on first use for each
dtype and cached on disk.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import checks, reference
from . import attention as cpu_attention
from .attention import _attend_all, _attend_all_tiles, _jit, available
from .fastmath import as_array, exp_f32, load_f32, long_lived, round_to, store_f32

if available():
    from .tiles import (
        add_square_sum_tile,
        rotate_tile,
        scale_tile,
        silu_mul_tile,
        square_sum_tile,
    )

# The dtypes the compiled kernels take; numba has no fp16 arithmetic.
DTYPES = (torch.float32, torch.bfloat16)


def _compiled(*tensors: object) -> bool:
    """Whether the compiled kernels take these arguments (else the reference, whose
    checks name whatever is wrong with them). ``is_cpu`` rather than ``device``,
    which builds a device object: these guards run before every op of a layer,
    cold after each product (docs/kernels.md)."""
    return _AVAILABLE and all(
        isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in DTYPES for t in tensors
    )


_AVAILABLE = available()


# The gated activations, in the tensor's dtype as Hugging Face's MLPs compute them
# (the activation rounded, then the product). torch's vectorized exponential beats
# a compiled scalar loop over the rows: in a 144M model's decode step of 32 rows,
# 3.3 ms a step against 6–23 ms, and 1.5 against 5 ms for the fp32 round trip of
# :func:`reference.silu_mul`; a 512-token bf16 prefill step of a 144M Gemma 2 spent
# ~28 ms more in :func:`reference.gelu_tanh_mul`'s. A vector tile beats torch's two
# passes (docs/kernels.md): bf16 SiLU·mul takes it where the CPU runs it.
gelu_tanh_mul = reference.gelu_tanh_mul_in_dtype


@_jit()
def _silu_mul_rows_bf16(x, out):
    """``out[i] = round(silu(x[i, :d])) * x[i, d:]`` (rounded) for bf16 rows as
    their bits, ``d`` = ``out``'s width: whole tiles of 16 values by
    :func:`.cpu_tiles.silu_mul_tile`, the rest of a row one value at a time (the
    same exponential, so the same values)."""
    rows, width = out.shape
    chunks = width // 16
    x_flat, out_flat = x.reshape(-1), out.reshape(-1)
    for i in range(rows):
        silu_mul_tile(x_flat, 2 * i * width, (2 * i + 1) * width, out_flat, i * width, chunks)
        for j in range(16 * chunks, width):
            g = load_f32(x, (i, j))
            silu = round_to(out, g / (np.float32(1.0) + exp_f32(-g)))
            store_f32(out, (i, j), silu * load_f32(x, (i, width + j)))


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`reference.silu_mul_in_dtype` (the SiLU of ``x[:, :d]`` rounded to the
    dtype, times ``x[:, d:]``, rounded), in one pass over each row for contiguous
    bf16 rows. Equal to torch's in tests over millions of values; its exponential
    saturates where torch's overflows, so a row holding ``-inf`` gets ``-inf·u``
    where torch gets NaN."""
    if not (_compiled(x) and x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous()):
        return reference.silu_mul_in_dtype(x)
    checks.check_silu_mul(x)
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    if x.shape[0]:
        _silu_mul_rows_bf16(as_array(x), as_array(out))
    return out


def _on_cpu(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.is_cpu


# Rounded where the reference rounds (Hugging Face's order): the sum with the
# residual in the tensors' dtype, the normalised row cast to it before the weight
# multiplies, the product cast again. In fp32 each rounding is the identity.


@_jit()
def _rms_norm_rows(x, weight, eps, out):
    rows, width = x.shape
    for i in range(rows):
        total = np.float32(0.0)  # fp32, as the reference's mean: 1.5x faster than fp64
        for j in range(width):
            v = load_f32(x, (i, j))
            total += v * v
        inv = np.float32(1.0 / math.sqrt(total / width + eps))
        for j in range(width):
            normed = round_to(out, load_f32(x, (i, j)) * inv)
            store_f32(out, (i, j), load_f32(weight, j) * normed)


@_jit()
def _add_rms_norm_rows(x, residual, weight, eps, out, summed):
    rows, width = x.shape
    for i in range(rows):
        total = np.float32(0.0)  # fp32, as the reference's mean: 1.5x faster than fp64
        for j in range(width):
            s = round_to(summed, load_f32(x, (i, j)) + load_f32(residual, (i, j)))
            store_f32(summed, (i, j), s)
            total += s * s
        inv = np.float32(1.0 / math.sqrt(total / width + eps))
        for j in range(width):
            normed = round_to(out, load_f32(summed, (i, j)) * inv)
            store_f32(out, (i, j), load_f32(weight, j) * normed)


@_jit()
def _rms_norm_rows_bf16(x, weight, eps, out):
    """:func:`_rms_norm_rows` for bf16 rows of a multiple of 16 values, in vector
    tiles (:mod:`.cpu_tiles`); ``x`` and ``out`` as ``[rows, width]`` bits."""
    rows, width = x.shape
    chunks = width // 16
    x_flat, out_flat = x.reshape(-1), out.reshape(-1)
    for i in range(rows):
        total = square_sum_tile(x_flat, i * width, chunks)
        inv = np.float32(1.0 / math.sqrt(total / width + eps))
        scale_tile(x_flat, i * width, weight, inv, out_flat, i * width, chunks)


@_jit()
def _add_rms_norm_rows_bf16(x, residual, weight, eps, out, summed):
    """:func:`_add_rms_norm_rows` in vector tiles, as :func:`_rms_norm_rows_bf16`."""
    rows, width = x.shape
    chunks = width // 16
    x_flat, r_flat = x.reshape(-1), residual.reshape(-1)
    out_flat, s_flat = out.reshape(-1), summed.reshape(-1)
    for i in range(rows):
        total = add_square_sum_tile(x_flat, i * width, r_flat, i * width, s_flat, i * width,
                                    chunks)  # fmt: skip
        inv = np.float32(1.0 / math.sqrt(total / width + eps))
        scale_tile(s_flat, i * width, weight, inv, out_flat, i * width, chunks)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference.rms_norm` in one pass over each row."""
    if not _compiled(x, weight) or (residual is not None and not _compiled(residual)):
        return reference.rms_norm(x, weight, eps, residual)
    checks.check_rms_norm(x, weight, eps, residual)
    # Plain allocations: placing the outputs off their inputs' 4K alias cost more
    # than it saved in every decode step measured (docs/kernels.md, 4K aliasing).
    # vector tiles for bf16 rows that are contiguous, in whole tiles
    tiles = (
        x.dtype == weight.dtype == torch.bfloat16
        and x.shape[1] % 16 == 0
        and x.is_contiguous()
        and (residual is None or residual.is_contiguous())
    )
    if residual is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        kernel = _rms_norm_rows_bf16 if tiles else _rms_norm_rows
        kernel(as_array(x), as_array(weight), float(eps), as_array(out))
        return out
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    (_add_rms_norm_rows_bf16 if tiles else _add_rms_norm_rows)(
        as_array(x), as_array(residual), as_array(weight), float(eps), as_array(out),
        as_array(summed),
    )  # fmt: skip
    return out, summed


@_jit()
def _rotate_head(x, t, h, cos_sin, p, out, row):
    """Head ``h`` of token ``t`` of ``x`` rotated to position ``p``, into head ``h``
    of ``out``'s row ``row``."""
    half = x.shape[2] // 2
    for j in range(half):
        c, s = cos_sin[p, j], cos_sin[p, half + j]
        x1, x2 = load_f32(x, (t, h, j)), load_f32(x, (t, h, half + j))
        store_f32(out, (row, h, j), x1 * c - x2 * s)
        store_f32(out, (row, h, half + j), x2 * c + x1 * s)


@_jit()
def _rotate(x, positions, cos_sin, out):
    tokens, heads = x.shape[0], x.shape[1]
    for t in range(tokens):
        for h in range(heads):
            _rotate_head(x, t, h, cos_sin, positions[t], out, t)


@_jit()
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
        not _compiled(query, key, cos_sin_cache)
        or cos_sin_cache.dtype != torch.float32
        or not _on_cpu(positions)
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


@_jit()
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


@_jit()
def _rotate_store_rows(query, key, value, positions, cos_sin, q_out, k_slots, v_slots, slots):
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


@_jit()
def _rotate_store_rows_bf16(
    query, q_stride, key, k_stride, value, v_stride, positions, cos_sin, q_out, k_slots, v_slots,
    slots,
):  # fmt: skip
    """:func:`_rotate_store_rows` for bf16 heads of a multiple of 32 values, each
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


def _rows_span(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` ([tokens, heads, head_dim], each row's heads side by side) as a 1-D
    view from its first element to its last, and its row stride."""
    tokens, heads, head_dim = x.shape
    stride = x.stride(0)
    return x.as_strided(((tokens - 1) * stride + heads * head_dim,), (1,)), stride


def _rotates_in_tiles(query, key, value, cos_sin_cache, head_dim) -> bool:
    """Whether :func:`_rotate_store_rows_bf16` takes these rows: bf16 heads of a
    multiple of 32 values, each row's heads side by side, at least one row, a
    contiguous cos/sin table as wide as a head."""
    return (
        query.dtype == torch.bfloat16
        and head_dim % 32 == 0
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
        not _compiled(query, key, value, k_cache, v_cache, cos_sin_cache)
        or cos_sin_cache.dtype != torch.float32
        or len({query.dtype, key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}) > 1
        or not (_on_cpu(positions) and _on_cpu(slot_mapping))
    ):
        return reference.rotary_store_kv(positions, query, key, value, cos_sin_cache, k_cache,
                                         v_cache, slot_mapping)  # fmt: skip
    checks.check_rotary_embedding(positions, query, key, cos_sin_cache)
    checks.check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    _, _, num_kv_heads, head_dim = k_cache.shape
    pos, slots = positions.numpy(), slot_mapping.numpy()
    q_out = torch.empty(query.shape, dtype=query.dtype)
    if _rotates_in_tiles(query, key, value, cos_sin_cache, head_dim):
        (q, q_stride), (k, k_stride), (v, v_stride) = map(_rows_span, (query, key, value))
        bad = _rotate_store_rows_bf16(
            as_array(q), q_stride, as_array(k), k_stride, as_array(v), v_stride, pos,
            cos_sin_cache.numpy(), as_array(q_out.view(q_out.shape[0], -1)),
            as_array(k_cache.view(-1, num_kv_heads * head_dim)),
            as_array(v_cache.view(-1, num_kv_heads * head_dim)), slots,
        )  # fmt: skip
    else:
        bad = _rotate_store_rows(
            as_array(query), as_array(key), as_array(value), pos, cos_sin_cache.numpy(),
            as_array(q_out), as_array(k_cache.view(-1, num_kv_heads, head_dim)),
            as_array(v_cache.view(-1, num_kv_heads, head_dim)), slots,
        )  # fmt: skip
    _refuse_bad_token(bad, pos, slots, cos_sin_cache, k_cache)
    return q_out


def _refuse_bad_token(bad: int, pos: np.ndarray, slots: np.ndarray, cos_sin_cache, k_cache):
    """Raises for what :func:`_rotate_store_rows` found (``bad``, -1 for nothing):
    a position outside the rotary table, or a slot past the cache."""
    if bad >= pos.shape[0]:
        reference.check_largest_slot(int(slots[bad - pos.shape[0]]), k_cache)
    elif bad >= 0:
        raise IndexError(
            f"positions[{bad}]={int(pos[bad])} is outside the cos/sin cache of "
            f"{cos_sin_cache.shape[0]} positions"
        )


@_jit()
def _rotate_store_attend_rows(
    qkv, q_width, kv_width, positions, cos_sin, q_out, k_slots, v_slots, slots, k_cache, v_cache,
    tables, table_of, starts, lengths, rows, scale, soft_cap, out, amx,
):  # fmt: skip
    """:func:`_rotate_store_rows_bf16` of a product's ``qkv`` rows (the query's
    ``q_width`` values, then the key's and the value's ``kv_width``), then every
    row attended by :func:`.cpu_attention._attend_all_tiles` into ``out``. Returns
    what the first returns: -1, or the bad token that stopped it before anything
    was written."""
    stride = qkv.shape[1]
    flat = qkv.reshape(-1)
    bad = _rotate_store_rows_bf16(flat, stride, flat[q_width:], stride, flat[q_width + kv_width:],
                                  stride, positions, cos_sin, q_out.reshape(q_out.shape[0], -1),
                                  k_slots, v_slots, slots)  # fmt: skip
    if bad < 0:
        _attend_all_tiles(q_out, k_cache, v_cache, tables, table_of, starts, lengths, rows, scale,
                          soft_cap, out, amx)  # fmt: skip
    return bad


@_jit()
def _rotate_store_attend_rows_loops(
    query, key, value, positions, cos_sin, q_out, k_slots, v_slots, slots, k_cache, v_cache,
    tables, table_of, lengths, rows, scale, out,
):  # fmt: skip
    """:func:`_rotate_store_attend_rows` on the loop kernels (any head size, fp32):
    :func:`_rotate_store_rows`, then :func:`.cpu_attention._attend_all`."""
    bad = _rotate_store_rows(query, key, value, positions, cos_sin, q_out, k_slots, v_slots,
                             slots)  # fmt: skip
    if bad < 0:
        _attend_all(q_out, k_cache, v_cache, tables, table_of, lengths, rows, scale, out)
    return bad


def _cache_arrays(cache: torch.Tensor):
    """A contiguous fp32 or bf16 cache ``[blocks, block_size, kv_heads,
    head_dim]`` as the attention kernels read it, and its slots as rows (for the
    rotary tiles) and as heads (for the loop kernel); None where it is not one."""
    if not (
        isinstance(cache, torch.Tensor) and cache.is_cpu and cache.dtype in DTYPES
        and cache.dim() == 4 and cache.is_contiguous()
    ):  # fmt: skip
        return None
    array = as_array(cache)
    slots = array.reshape(-1, cache.shape[2], cache.shape[3])
    return array, slots.reshape(slots.shape[0], -1), slots


def _table_array(table: torch.Tensor):
    """A contiguous fp32 rotary table as an array, or None."""
    if not (
        isinstance(table, torch.Tensor) and table.is_cpu and table.dtype == torch.float32
        and table.dim() == 2 and table.is_contiguous()
    ):  # fmt: skip
        return None
    return table.numpy()


def _same_rope(plan, positions, slot_mapping) -> bool:
    """Whether ``plan`` holds these positions and slots, unchanged since."""
    rope = plan.rope
    return (
        rope is not None
        and rope[2] is not None
        and rope[0] is positions
        and rope[1] is slot_mapping
        and rope[2] == (positions._version, slot_mapping._version)
    )


def _rotate_store_attend_in_one_call(
    positions, qkv, num_heads, num_kv_heads, cos_sin_cache, k_cache, v_cache, slot_mapping,
    block_tables, seq_lens, query_start_loc, scale, max_seq_len, window, soft_cap,
) -> torch.Tensor | None:  # fmt: skip
    """:func:`rotary_store_attend` in one compiled call where it applies, else
    None (for the two ops one after the other): rows every one of which the
    row kernels take (decode rows and short prefill pieces), on one thread; bf16
    where the attention and rotary tiles take them (any window or cap), fp32
    without a window that cuts or a cap. What the two ops check is checked once
    a batch (a plan) and once a cache or table, not once a layer."""
    if not (
        _ONE_CALL and _AVAILABLE and isinstance(qkv, torch.Tensor) and qkv.dtype in DTYPES
        and qkv.dim() == 2 and qkv.shape[0] > 0 and qkv.is_contiguous()
        and torch.get_num_threads() == 1
    ):  # fmt: skip
        return None
    k_arrays = long_lived(k_cache, _cache_arrays)
    v_arrays = long_lived(v_cache, _cache_arrays)
    table = long_lived(cos_sin_cache, _table_array)
    if (
        k_arrays is None or v_arrays is None or table is None or k_cache.shape != v_cache.shape
        or k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype
    ):  # fmt: skip
        return None
    n = qkv.shape[0]
    _, block_size, kv_heads, head_dim = k_cache.shape
    tiles = qkv.dtype == torch.bfloat16
    if (
        not isinstance(num_heads, int) or not isinstance(num_kv_heads, int)
        or num_kv_heads != kv_heads or num_heads % kv_heads
        or qkv.shape[1] != (num_heads + 2 * kv_heads) * head_dim
        or table.shape[1] != head_dim
        or (tiles and (head_dim % 32 or not cpu_attention._tiles_apply(qkv, k_cache)))
    ):  # fmt: skip
        return None
    if not (
        isinstance(scale, (int, float)) and scale > 0
        and (window is None or (type(window) is int and window > 0))
        and (soft_cap is None or (isinstance(soft_cap, (int, float)) and soft_cap > 0))
    ):  # fmt: skip
        return None  # the two ops name what is wrong
    cuts = window is not None and (max_seq_len is None or max_seq_len > window)
    if not tiles and (cuts or soft_cap is not None):
        return None
    # the heads as views: the loop kernels read them; the checks, on a new batch
    heads = None if tiles else reference.split_qkv(qkv, num_heads, num_kv_heads, k_cache)
    inputs = (block_tables, seq_lens, query_start_loc, n, num_heads, block_size)
    plan = cpu_attention._reused_plan(inputs)
    if plan is None:  # a new batch: everything the two ops check, once
        heads = heads or reference.split_qkv(qkv, num_heads, num_kv_heads, k_cache)
        checks.check_paged_attention(heads[0], k_cache, v_cache, block_tables, seq_lens,
                                     query_start_loc, scale, window, soft_cap)  # fmt: skip
        plan = cpu_attention._plan(n, num_heads, block_size, block_tables, seq_lens,
                                   query_start_loc)  # fmt: skip
    if plan.pieces.long or plan.rows is None or plan.versions is None:
        return None
    if not _same_rope(plan, positions, slot_mapping):
        heads = heads or reference.split_qkv(qkv, num_heads, num_kv_heads, k_cache)
        q, k, v = heads
        checks.check_rotary_embedding(positions, q, k, cos_sin_cache)
        checks.check_store_kv(k, v, k_cache, v_cache, slot_mapping)
        if not (_on_cpu(positions) and _on_cpu(slot_mapping)):
            return None
        versions = None  # inference tensors have no version counter: never reused
        if not (positions.is_inference() or slot_mapping.is_inference()):
            versions = (positions._version, slot_mapping._version)
        plan.rope = (positions, slot_mapping, versions, positions.numpy(), slot_mapping.numpy())
    pos, slots = plan.rope[3], plan.rope[4]
    tables, table_of, lengths, rows = plan.rows
    q_out = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype)
    out = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype)
    if tiles:
        bad = _rotate_store_attend_rows(
            as_array(qkv), num_heads * head_dim, kv_heads * head_dim, pos, table,
            as_array(q_out), k_arrays[1], v_arrays[1], slots, k_arrays[0], v_arrays[0], tables,
            table_of, cpu_attention._row_starts(plan, window if cuts else None), lengths, rows,
            np.float32(scale), np.float32(0.0 if soft_cap is None else soft_cap), as_array(out),
            cpu_attention._amx_groups_apply(q_out, k_cache),
        )  # fmt: skip
    else:
        q, k, v = heads
        bad = _rotate_store_attend_rows_loops(
            as_array(q), as_array(k), as_array(v), pos, table, as_array(q_out), k_arrays[2],
            v_arrays[2], slots, k_arrays[0], v_arrays[0], tables, table_of, lengths, rows,
            np.float32(scale), as_array(out),
        )  # fmt: skip
    _refuse_bad_token(bad, pos, slots, cos_sin_cache, k_cache)
    return out.view(n, num_heads * head_dim)


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
) -> torch.Tensor:
    """:func:`reference.rotary_store_attend`. A batch of decode rows and short
    prefill pieces runs as one compiled call (the heads rotated, the new keys and
    values stored, every row attended), its checks made once a batch:
    after each matrix product has streamed a layer's weights through the
    caches, every op between two products costs ~50–80 µs beyond its kernel
    (docs/kernels.md), and this takes one op and the views between them out of
    each layer. Anything else is :func:`rotary_store_kv`, then
    :func:`.cpu_attention.paged_attention`."""
    if _ONE_CALL:
        out = _rotate_store_attend_in_one_call(
            positions, qkv, num_heads, num_kv_heads, cos_sin_cache, k_cache, v_cache,
            slot_mapping, block_tables, seq_lens, query_start_loc, scale, max_seq_len, window,
            soft_cap,
        )  # fmt: skip
        if out is not None:
            return out
    return _rotary_store_then_attend(
        positions, qkv, num_heads, num_kv_heads, cos_sin_cache, k_cache, v_cache, slot_mapping,
        block_tables, seq_lens, query_start_loc, scale, max_query_len=max_query_len,
        max_seq_len=max_seq_len, window=window, soft_cap=soft_cap,
    )  # fmt: skip


@_jit()
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


@_jit()
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
        not _compiled(key, value, k_cache, v_cache)
        or len({key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}) > 1
        or not _on_cpu(slot_mapping)
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


_rotary_store_then_attend = reference.rotary_store_then_attend(
    rotary_store_kv, cpu_attention.paged_attention
)
# Whether rotary_store_attend takes its one-call path where it applies
# (_rotate_store_attend_in_one_call decides where); False: always the two ops.
_ONE_CALL = True
