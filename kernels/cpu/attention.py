"""Paged attention for CPU ranks, compiled with numba.

The torch reference attends a batch's decode rows by gathering every
sequence's KV blocks into one padded tensor and running batched matmuls of one
query row each: the gather copies the whole KV once more than attention reads
it, and each batch item is a separate tiny matmul. This kernel reads each
sequence's blocks where they lie in the paged cache, once and in order, every
query head sharing that read, in a softmax of known length (no padding, no
masking). At 128 decode rows of the demo model, ~100 positions each, a layer's
KV (13 MB) no longer fits the CPU's caches, so the kernel is bound by memory:
a block's 8 KiB arrive as the hardware prefetcher starts over on each, so the
kernel asks for the blocks ahead of the one it reads itself, and computes the
softmax's exponentials in vector registers (:mod:`.cpu_math`).

Short prefill pieces run here too, row by row, each row seeing the positions up
to its own (:data:`SHORT_PIECE_WORK`); longer pieces, whose many rows make
blocked matrix products efficient, go in bf16 on CPUs with AMX to the AMX tile
kernel (:mod:`.cpu_amx`, all of a batch's pieces in one call, ~2x torch's), else
to torch's CPU flash attention (:func:`attend_long_pieces`: their blocks read in
place where they are one run, else gathered once, then
``scaled_dot_product_attention``, which keeps K/V shared across each GQA group).
How a batch splits is read from its metadata once and reused by every layer
(:func:`_plan`). fp32 and bf16 (a bf16 cache is read as fp32 as it streams
past, :mod:`.cpu_math`; scores and sums stay fp32); numba has no fp16, which
takes the reference path. On CPUs with AVX-512 BF16 a bf16 cache takes a
kernel whose products are register tiles (:mod:`.cpu_tiles`,
:func:`_attend_one_tiles`). A soft cap (Gemma 2), or a sliding window shorter
than the longest sequence, runs on a second set of compiled functions
(:func:`_paged_attention_window_cap`): the plain ones stay as they are, since
the window's offsets and the cap's branch in their loops slow every other
model's decode. With more than one torch thread the rows are
split across numba's threads (as many as torch's). The kernel is compiled on
first use (about a second) and cached on disk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ...scheduler.blocks import blocks_for
from .. import checks, reference
from . import amx as cpu_amx
from . import tiles as cpu_tiles
from .fastmath import as_array, exp_f32, load_f32, prefetch_l2, store_f32, tanh_f32
from .tiles import HEADS, POSITIONS, VALUES, pv_tile, qk_tile, spread_scores

logger = logging.getLogger(__name__)

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; degrade rather than fail
    numba = None

if numba is not None:
    # Compiled lazily, on the first call with each argument type; cached on disk.
    # numpy's error model: a float division by zero gives inf rather than raising,
    # which spares every division its branch, so loops holding one vectorize.
    def _jit(parallel: bool = False):
        return numba.njit(
            parallel=parallel, fastmath=True, nogil=True, cache=True, boundscheck=False,
            error_model="numpy",
        )  # fmt: skip

    prange = numba.prange
else:

    def _jit(parallel: bool = False):
        return lambda fn: fn

    prange = range


# A prefill piece of at most this many query rows x positions x query heads runs
# on the row kernel too, whose time grows with all three; longer ones on torch's
# flash attention, ~80 µs a piece and then little per position. Measured in bf16,
# 4 pieces at once, 16/4 heads of 64: a 16-token prompt (4096) 0.25 ms on the
# kernel against 0.36; 32 tokens (16384) 0.73 against 0.46; 64 tokens 2.3 against
# 0.8; 64 after 200 cached 16.0 against 3.6; 128 tokens 12.7 against 1.9 (the
# reference's fp32 products: 6.7). fp32, 16 pieces, 4/2 heads: 32 tokens (4096)
# 0.92 against 1.03; 64 tokens 2.8 against 1.8.
SHORT_PIECE_WORK = 8192


def available() -> bool:
    """Whether the compiled kernel can run here (numba imports)."""
    return numba is not None


# How many KV blocks ahead of the one being read a row asks for (cpu_math.prefetch_l2):
# one block takes about as long to arrive as two to compute with.
PREFETCH_BLOCKS = 2


@_jit()
def _prefetch_block(rows, block, rows_per_block, head_dim):
    first = block * rows_per_block * head_dim
    for line in range(0, rows_per_block * head_dim, 64 // rows.itemsize):  # a 64-byte line
        prefetch_l2(rows, first + line)


@_jit()
def _attend_one(
    q, k_rows, v_rows, table, length, next_table, next_length, row, scale, out,
    scores, acc, qh, top, block_size, num_kv_heads,
):  # fmt: skip
    """One sequence's decode row, every query head at once: each block of K, then
    of V, is read once, front to back (a position's KV heads lie side by side), so
    the cache is streamed rather than revisited; the inner loops run over 1-D rows
    and vectorize. ``k_rows``/``v_rows`` are the caches as ``[slot * num_kv_heads
    + head, head_dim]``; ``scores``, ``acc``, ``qh`` and ``top`` are scratch of
    ``[num_heads, ...]``. Each head's largest score is kept as the scores are made
    (a separate pass over them does not vectorize: numba's max reduction stays
    scalar), and the softmax's division is left to the output row, one multiply
    per output element instead of one per score. While a block is read, the one
    :data:`PREFETCH_BLOCKS`
    further along this row's K blocks, then its V blocks, then the next row's K
    blocks (``next_table``, ``next_length``) is fetched into L2."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = (length + block_size - 1) // block_size
    next_blocks = (next_length + block_size - 1) // block_size
    per_block = block_size * num_kv_heads
    for i in range(num_heads):
        top[i] = np.float32(-3.0e38)
        for d in range(head_dim):
            qh[i, d] = load_f32(q, (row, i, d)) * scale
            acc[i, d] = 0.0
    for j in range(num_blocks):
        ahead = j + PREFETCH_BLOCKS
        if ahead < num_blocks:
            _prefetch_block(k_rows, table[ahead], per_block, head_dim)
        elif ahead < 2 * num_blocks:
            _prefetch_block(v_rows, table[ahead - num_blocks], per_block, head_dim)
        first = table[j] * per_block
        for o in range(min(block_size, length - j * block_size)):
            for h in range(num_kv_heads):
                k_row = k_rows[first + o * num_kv_heads + h]
                for g in range(group):
                    x = np.float32(0.0)
                    for d in range(head_dim):
                        x += qh[h * group + g, d] * load_f32(k_row, d)
                    scores[h * group + g, j * block_size + o] = x
                    top[h * group + g] = max(top[h * group + g], x)
    for i in range(num_heads):
        head_scores, largest = scores[i], top[i]
        total = np.float32(0.0)
        for p in range(length):
            e = exp_f32(head_scores[p] - largest)
            head_scores[p] = e
            total += e
        top[i] = np.float32(1.0) / total  # from here on: the head's normaliser
    for j in range(num_blocks):
        ahead = j + PREFETCH_BLOCKS
        if ahead < num_blocks:
            _prefetch_block(v_rows, table[ahead], per_block, head_dim)
        elif ahead - num_blocks < next_blocks:
            _prefetch_block(k_rows, next_table[ahead - num_blocks], per_block, head_dim)
        first = table[j] * per_block
        for o in range(min(block_size, length - j * block_size)):
            p = j * block_size + o
            for h in range(num_kv_heads):
                v_row = v_rows[first + o * num_kv_heads + h]
                for g in range(group):
                    w = scores[h * group + g, p]
                    for d in range(head_dim):
                        acc[h * group + g, d] += w * load_f32(v_row, d)
    for i in range(num_heads):
        for d in range(head_dim):
            store_f32(out, (row, i, d), acc[i, d] * top[i])


@_jit()
def _attend_row(
    q, k_rows, v_rows, tables, table_of, lengths, rows, r, scale, out, scores, acc, qh, top,
    block_size, num_kv_heads,
):  # fmt: skip
    """Row ``r`` of the batch, prefetching the first KV blocks of row ``r + 1``."""
    n = lengths.shape[0]
    following = min(r + 1, n - 1)
    _attend_one(
        q, k_rows, v_rows, tables[table_of[r]], lengths[r], tables[table_of[following]],
        lengths[following] if r + 1 < n else 0, rows[r], scale, out, scores, acc, qh, top,
        block_size, num_kv_heads,
    )  # fmt: skip


@_jit()
def _attend_all(q, k_cache, v_cache, tables, table_of, lengths, rows, scale, out):
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    k_rows, v_rows = k_cache.reshape(-1, head_dim), v_cache.reshape(-1, head_dim)
    n = lengths.shape[0]
    longest = 1
    for r in range(n):
        longest = max(longest, lengths[r])
    scores = np.empty((num_heads, longest), dtype=np.float32)
    acc = np.empty((num_heads, head_dim), dtype=np.float32)
    qh = np.empty((num_heads, head_dim), dtype=np.float32)
    top = np.empty(num_heads, dtype=np.float32)
    if n:  # the first row's first blocks; every later row's come with the row before
        for j in range(min(PREFETCH_BLOCKS, (lengths[0] + block_size - 1) // block_size)):
            _prefetch_block(k_rows, tables[table_of[0], j], block_size * num_kv_heads, head_dim)
    for r in range(n):
        _attend_row(q, k_rows, v_rows, tables, table_of, lengths, rows, r, scale, out,
                    scores, acc, qh, top, block_size, num_kv_heads)  # fmt: skip


@_jit(parallel=True)
def _attend_all_parallel(q, k_cache, v_cache, tables, table_of, lengths, rows, scale, out):
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    k_rows, v_rows = k_cache.reshape(-1, head_dim), v_cache.reshape(-1, head_dim)
    n = lengths.shape[0]
    for r in prange(n):
        scores = np.empty((num_heads, max(lengths[r], 1)), dtype=np.float32)
        acc = np.empty((num_heads, head_dim), dtype=np.float32)
        qh = np.empty((num_heads, head_dim), dtype=np.float32)
        top = np.empty(num_heads, dtype=np.float32)
        _attend_row(q, k_rows, v_rows, tables, table_of, lengths, rows, r, scale, out,
                    scores, acc, qh, top, block_size, num_kv_heads)  # fmt: skip


# The bf16 kernel on CPUs with AVX-512 BF16 (:mod:`.cpu_tiles`): the same rows,
# reads and softmax as :func:`_attend_one`, its products made in register tiles.
# A block's 16 positions against one query head are one score tile; a run of a
# block's positions into up to 8 heads' accumulators one PV tile. The blocks
# ahead are fetched a slice per tile, spread over the block being read: asked
# for in one burst, as :func:`_attend_one` does, a block's 128 lines fill the
# core's miss queue and the tiles stall behind them (0.55 against 0.48 ms a
# layer at 32 rows over 160 positions, one core; 1.13 ms for :func:`_attend_one`).


@_jit()
def _prefetch_slice(rows, block, per_block, head_dim, part, parts):
    """Slice ``part`` of ``parts`` of :func:`_prefetch_block`'s lines."""
    step = 64 // rows.itemsize
    lines = per_block * head_dim // step
    first = block * per_block * head_dim
    for line in range(part * lines // parts, (part + 1) * lines // parts):
        prefetch_l2(rows, first + line * step)


# The tiles serve every model: a row reads positions ``start..length - 1``
# (``start`` 0 without a window that cuts), from the block holding ``start`` on,
# its scores indexed from that block's first slot; score tiles start at 16-slot
# boundaries, so the slots of the first tile before ``start`` are scored too and
# then left out of the largest score, the softmax and the PV tiles. A soft cap of
# 0 caps nothing. Unlike the loop kernels, the tiles take the window and the cap
# as arguments: a separate plain copy measured ~3% faster on the attention alone
# (0.548 against 0.566 ms a layer, 32 rows over 160 positions), ~0.4% of a step.


@_jit()
def _attend_one_tiles(
    q, k_flat, v_flat, table, start, length, next_table, next_start, next_length, row, scale,
    soft_cap, out, scores, acc, top, block_size, num_kv_heads, amx, packed, tile, config,
):  # fmt: skip
    """:func:`_attend_one_window_cap` in tiles: positions ``start..length - 1``,
    each scaled score capped as ``soft_cap * tanh(score / soft_cap)`` (0:
    uncapped) in the softmax pass. ``k_flat``/``v_flat`` are the caches' bits as
    1-D arrays, ``scores`` is ``[num_heads, length rounded up to a block]`` (a
    score tile writes all 16 of its positions, the ones past ``length`` from
    whatever their slots hold, and nothing reads those). With ``amx`` the scores
    of a KV head's group of query heads come from one AMX product a 16-position
    tile (:func:`.cpu_amx.group_scores`; ``packed``, ``tile`` and ``config`` its
    scratch), else from a :func:`.cpu_tiles.qk_tile` a query head."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    if amx:
        cpu_amx.pack_group_queries(q.view(np.uint32), row, num_kv_heads, group, packed)
        cpu_amx.configure_group_tiles(config, group)
    first_block = start // block_size
    num_blocks = (length + block_size - 1) // block_size - first_block
    next_first = next_start // block_size
    next_blocks = (next_length + block_size - 1) // block_size - next_first
    per_block = block_size * num_kv_heads
    stride = num_kv_heads * head_dim
    width = scores.shape[1]
    q_flat, s_flat, a_flat = q.reshape(-1), scores.reshape(-1), acc.reshape(-1)
    chunks = head_dim // 32
    q_row = row * num_heads * head_dim
    skip = start - first_block * block_size  # the first block's slots before the window
    count = length - first_block * block_size  # score indices 0..count - 1, from `skip` on read
    for i in range(num_heads):
        top[i] = np.float32(-3.0e38)
    for jj in range(num_blocks):
        j = first_block + jj
        ahead = jj + PREFETCH_BLOCKS
        first = table[j] * per_block * head_dim
        inside = min(block_size, length - j * block_size)
        for o in range(skip // POSITIONS * POSITIONS if jj == 0 else 0, inside, POSITIONS):
            valid = min(POSITIONS, inside - o)
            lowest = max(skip - o, 0) if jj == 0 else 0  # the tile's slots before the window
            for h in range(num_kv_heads):
                k_at = first + o * stride + h * head_dim
                if amx:
                    if o == 0 and ahead < num_blocks:
                        _prefetch_slice(k_flat, table[first_block + ahead], per_block, head_dim,
                                        h, num_kv_heads)  # fmt: skip
                    elif o == 0 and ahead < 2 * num_blocks:
                        _prefetch_slice(v_flat, table[first_block + ahead - num_blocks], per_block,
                                        head_dim, h, num_kv_heads)  # fmt: skip
                    cpu_amx.group_scores(k_flat, k_at, stride * 2, packed, h, chunks, group, tile)
                    spread_scores(group, tile, scale, s_flat,
                                  h * group * width + jj * block_size + o, width, top, h * group,
                                  lowest, valid)  # fmt: skip
                    continue
                for i in range(h * group, (h + 1) * group):
                    if o == 0 and ahead < num_blocks:
                        _prefetch_slice(k_flat, table[first_block + ahead], per_block, head_dim,
                                        i, num_heads)  # fmt: skip
                    elif o == 0 and ahead < 2 * num_blocks:
                        _prefetch_slice(v_flat, table[first_block + ahead - num_blocks], per_block,
                                        head_dim, i, num_heads)  # fmt: skip
                    largest = qk_tile(q_flat, q_row + i * head_dim, k_flat, k_at, stride, chunks,
                                      scale, s_flat, i * width + jj * block_size + o, lowest,
                                      valid)  # fmt: skip
                    top[i] = max(top[i], largest)
    if amx:
        cpu_amx.release_tiles()
    for i in range(num_heads):
        # a view from the window's first slot: a loop from a nonzero start does not
        # vectorize (the softmax took as long as the rest of the kernel)
        head_scores = scores[i, skip:count]
        total = np.float32(0.0)
        if soft_cap > 0:
            inv_cap = np.float32(1.0) / soft_cap
            largest = soft_cap * tanh_f32(top[i] * inv_cap)
            for p in range(count - skip):
                e = exp_f32(soft_cap * tanh_f32(head_scores[p] * inv_cap) - largest)
                head_scores[p] = e
                total += e
        else:
            largest = top[i]
            for p in range(count - skip):
                e = exp_f32(head_scores[p] - largest)
                head_scores[p] = e
                total += e
        top[i] = np.float32(1.0) / total  # from here on: the head's normaliser
        for d in range(head_dim):
            acc[i, d] = 0.0
    for jj in range(num_blocks):
        j = first_block + jj
        ahead = jj + PREFETCH_BLOCKS
        first = table[j] * per_block * head_dim
        inside = min(block_size, length - j * block_size)
        begin = skip if jj == 0 else 0
        for h in range(num_kv_heads):
            if ahead < num_blocks:
                _prefetch_slice(v_flat, table[first_block + ahead], per_block, head_dim, h,
                                num_kv_heads)  # fmt: skip
            elif ahead - num_blocks < next_blocks:
                _prefetch_slice(k_flat, next_table[next_first + ahead - num_blocks], per_block,
                                head_dim, h, num_kv_heads)  # fmt: skip
            for i in range(h * group, (h + 1) * group, HEADS):
                heads = min(HEADS, (h + 1) * group - i)
                for d in range(0, head_dim, VALUES):
                    pv_tile(heads, a_flat, i * head_dim + d, head_dim, v_flat,
                            first + begin * stride + h * head_dim + d, stride, s_flat,
                            i * width + jj * block_size + begin, width, inside - begin)  # fmt: skip
    for i in range(num_heads):
        for d in range(head_dim):
            store_f32(out, (row, i, d), acc[i, d] * top[i])


@_jit()
def _attend_row_tiles(
    q, k_flat, v_flat, tables, table_of, starts, lengths, rows, r, scale, soft_cap, out, scores,
    acc, top, block_size, num_kv_heads, amx, packed, tile, config,
):  # fmt: skip
    n = lengths.shape[0]
    following = min(r + 1, n - 1)
    _attend_one_tiles(
        q, k_flat, v_flat, tables[table_of[r]], starts[r], lengths[r],
        tables[table_of[following]], starts[following], lengths[following] if r + 1 < n else 0,
        rows[r], scale, soft_cap, out, scores, acc, top, block_size, num_kv_heads, amx, packed,
        tile, config,
    )  # fmt: skip


@_jit()
def _attend_all_tiles(
    q, k_cache, v_cache, tables, table_of, starts, lengths, rows, scale, soft_cap, out, amx
):  # fmt: skip
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    packed, tile, config = _amx_scratch(num_heads, num_kv_heads, head_dim)
    k_flat, v_flat = k_cache.reshape(-1), v_cache.reshape(-1)
    n = lengths.shape[0]
    longest = 1
    for r in range(n):
        longest = max(longest, lengths[r])
    scores = np.empty((num_heads, (longest + block_size - 1) // block_size * block_size),
                      dtype=np.float32)  # fmt: skip
    acc = np.empty((num_heads, head_dim), dtype=np.float32)
    top = np.empty(num_heads, dtype=np.float32)
    if n:  # the first row's first blocks; every later row's come with the row before
        first = starts[0] // block_size
        for j in range(min(PREFETCH_BLOCKS, (lengths[0] + block_size - 1) // block_size - first)):
            _prefetch_block(k_flat, tables[table_of[0], first + j], block_size * num_kv_heads,
                            head_dim)  # fmt: skip
    for r in range(n):
        _attend_row_tiles(q, k_flat, v_flat, tables, table_of, starts, lengths, rows, r, scale,
                          soft_cap, out, scores, acc, top, block_size, num_kv_heads, amx, packed,
                          tile, config)  # fmt: skip


@_jit()
def _amx_scratch(num_heads, num_kv_heads, head_dim):
    """:func:`.cpu_amx.group_scores`'s scratch for one thread: the packed query,
    a score tile and the tile configuration."""
    return (
        np.empty(num_heads * head_dim // 2, dtype=np.uint32),
        np.empty(POSITIONS * (num_heads // num_kv_heads), dtype=np.float32),
        np.empty(64, dtype=np.uint8),
    )


@_jit(parallel=True)
def _attend_all_parallel_tiles(
    q, k_cache, v_cache, tables, table_of, starts, lengths, rows, scale, soft_cap, out, amx
):  # fmt: skip
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    k_flat, v_flat = k_cache.reshape(-1), v_cache.reshape(-1)
    n = lengths.shape[0]
    for r in prange(n):
        scores = np.empty((num_heads, (max(lengths[r], 1) + block_size - 1) // block_size
                           * block_size), dtype=np.float32)  # fmt: skip
        acc = np.empty((num_heads, head_dim), dtype=np.float32)
        top = np.empty(num_heads, dtype=np.float32)
        packed, tile, config = _amx_scratch(num_heads, num_kv_heads, head_dim)
        _attend_row_tiles(q, k_flat, v_flat, tables, table_of, starts, lengths, rows, r, scale,
                          soft_cap, out, scores, acc, top, block_size, num_kv_heads, amx, packed,
                          tile, config)  # fmt: skip


# The loop kernels' variant for sliding windows and soft caps. A second set of
# functions rather than arguments of :func:`_attend_one` and its callers: those
# are what every other model runs off the tiles, and the window's offsets and
# the cap's branch in their loops cost plain decode a quarter of its speed
# (docs/kernels.md). Each row reads its positions
# ``starts[r]..lengths[r] - 1`` (the blocks before its window are never read,
# the scheduler may have handed them on), its scores kept from index 0 on.


@_jit()
def _attend_one_window_cap(
    q, k_rows, v_rows, table, start, length, next_table, next_start, next_length, row, scale,
    soft_cap, out, scores, acc, qh, top, block_size, num_kv_heads,
):  # fmt: skip
    """:func:`_attend_one` over positions ``start..length - 1`` only, each scaled
    score capped as ``soft_cap * tanh(score / soft_cap)`` before the softmax
    (``soft_cap`` 0: uncapped). tanh is increasing, so the largest raw score,
    capped, is the largest capped one: it is kept raw as the scores are made and
    the cap is applied in the softmax pass, with the exponential."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    first_block = start // block_size
    num_blocks = (length + block_size - 1) // block_size - first_block
    next_first = next_start // block_size
    next_blocks = (next_length + block_size - 1) // block_size - next_first
    per_block = block_size * num_kv_heads
    for i in range(num_heads):
        top[i] = np.float32(-3.0e38)
        for d in range(head_dim):
            qh[i, d] = load_f32(q, (row, i, d)) * scale
            acc[i, d] = 0.0
    for jj in range(num_blocks):
        j = first_block + jj
        ahead = jj + PREFETCH_BLOCKS
        if ahead < num_blocks:
            _prefetch_block(k_rows, table[first_block + ahead], per_block, head_dim)
        elif ahead < 2 * num_blocks:
            _prefetch_block(v_rows, table[first_block + ahead - num_blocks], per_block, head_dim)
        first = table[j] * per_block
        base = j * block_size - start  # the score index of the block's slot 0
        for o in range(max(0, -base), min(block_size, length - j * block_size)):
            for h in range(num_kv_heads):
                k_row = k_rows[first + o * num_kv_heads + h]
                for g in range(group):
                    x = np.float32(0.0)
                    for d in range(head_dim):
                        x += qh[h * group + g, d] * load_f32(k_row, d)
                    scores[h * group + g, base + o] = x
                    top[h * group + g] = max(top[h * group + g], x)
    count = length - start
    for i in range(num_heads):
        head_scores = scores[i]
        total = np.float32(0.0)
        if soft_cap > 0:
            inv_cap = np.float32(1.0) / soft_cap
            largest = soft_cap * tanh_f32(top[i] * inv_cap)
            for p in range(count):
                e = exp_f32(soft_cap * tanh_f32(head_scores[p] * inv_cap) - largest)
                head_scores[p] = e
                total += e
        else:
            largest = top[i]
            for p in range(count):
                e = exp_f32(head_scores[p] - largest)
                head_scores[p] = e
                total += e
        top[i] = np.float32(1.0) / total  # from here on: the head's normaliser
    for jj in range(num_blocks):
        j = first_block + jj
        ahead = jj + PREFETCH_BLOCKS
        if ahead < num_blocks:
            _prefetch_block(v_rows, table[first_block + ahead], per_block, head_dim)
        elif ahead - num_blocks < next_blocks:
            _prefetch_block(k_rows, next_table[next_first + ahead - num_blocks], per_block,
                            head_dim)  # fmt: skip
        first = table[j] * per_block
        base = j * block_size - start
        for o in range(max(0, -base), min(block_size, length - j * block_size)):
            for h in range(num_kv_heads):
                v_row = v_rows[first + o * num_kv_heads + h]
                for g in range(group):
                    w = scores[h * group + g, base + o]
                    for d in range(head_dim):
                        acc[h * group + g, d] += w * load_f32(v_row, d)
    for i in range(num_heads):
        for d in range(head_dim):
            store_f32(out, (row, i, d), acc[i, d] * top[i])


@_jit()
def _attend_row_window_cap(
    q, k_rows, v_rows, tables, table_of, starts, lengths, rows, r, scale, soft_cap, out, scores,
    acc, qh, top, block_size, num_kv_heads,
):  # fmt: skip
    """Row ``r`` of the batch, prefetching the first KV blocks of row ``r + 1``."""
    n = lengths.shape[0]
    following = min(r + 1, n - 1)
    _attend_one_window_cap(
        q, k_rows, v_rows, tables[table_of[r]], starts[r], lengths[r],
        tables[table_of[following]], starts[following], lengths[following] if r + 1 < n else 0,
        rows[r], scale, soft_cap, out, scores, acc, qh, top, block_size, num_kv_heads,
    )  # fmt: skip


@_jit()
def _attend_all_window_cap(
    q, k_cache, v_cache, tables, table_of, starts, lengths, rows, scale, soft_cap, out
):  # fmt: skip
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    k_rows, v_rows = k_cache.reshape(-1, head_dim), v_cache.reshape(-1, head_dim)
    n = lengths.shape[0]
    longest = 1
    for r in range(n):
        longest = max(longest, lengths[r] - starts[r])
    scores = np.empty((num_heads, longest), dtype=np.float32)
    acc = np.empty((num_heads, head_dim), dtype=np.float32)
    qh = np.empty((num_heads, head_dim), dtype=np.float32)
    top = np.empty(num_heads, dtype=np.float32)
    if n:  # the first row's first blocks; every later row's come with the row before
        first = starts[0] // block_size
        for j in range(min(PREFETCH_BLOCKS, (lengths[0] + block_size - 1) // block_size - first)):
            _prefetch_block(k_rows, tables[table_of[0], first + j], block_size * num_kv_heads,
                            head_dim)  # fmt: skip
    for r in range(n):
        _attend_row_window_cap(q, k_rows, v_rows, tables, table_of, starts, lengths, rows, r,
                               scale, soft_cap, out, scores, acc, qh, top, block_size,
                               num_kv_heads)  # fmt: skip


@_jit(parallel=True)
def _attend_all_parallel_window_cap(
    q, k_cache, v_cache, tables, table_of, starts, lengths, rows, scale, soft_cap, out
):  # fmt: skip
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    k_rows, v_rows = k_cache.reshape(-1, head_dim), v_cache.reshape(-1, head_dim)
    n = lengths.shape[0]
    for r in prange(n):
        scores = np.empty((num_heads, max(lengths[r] - starts[r], 1)), dtype=np.float32)
        acc = np.empty((num_heads, head_dim), dtype=np.float32)
        qh = np.empty((num_heads, head_dim), dtype=np.float32)
        top = np.empty(num_heads, dtype=np.float32)
        _attend_row_window_cap(q, k_rows, v_rows, tables, table_of, starts, lengths, rows, r,
                               scale, soft_cap, out, scores, acc, qh, top, block_size,
                               num_kv_heads)  # fmt: skip


# The dtypes the kernel takes (a bf16 cache is read as fp32, :mod:`.cpu_math`).
DTYPES = (torch.float32, torch.bfloat16)


# Whether this CPU runs the bf16 tiles (AVX-512 BF16); False turns them off.
TILES = cpu_tiles.available()


# Whether this CPU runs AMX-BF16 tiles (and Linux lets this process use them); False
# turns the AMX prefill attention and the AMX decode scores off.
AMX = cpu_amx.available()


def _amx_applies(query) -> bool:
    """Whether long pieces take the AMX kernel: bf16 rows, :data:`AMX`, heads of
    whole 32-value chunks, each head's values side by side."""
    return (
        AMX
        and query.dtype == torch.bfloat16
        and query.shape[2] % VALUES == 0
        and query.stride(2) == 1
    )


def _amx_groups_apply(query, k_cache) -> bool:
    """Whether the tiles kernel takes its scores from AMX products
    (:func:`.cpu_amx.group_scores`): :data:`AMX` and a group of 1, 2, 4, 8 or 16
    query heads a KV head."""
    return AMX and query.shape[1] // k_cache.shape[2] in cpu_amx.GROUPS


def _tiles_apply(query, k_cache) -> bool:
    """Whether the tiles kernel attends these rows: a bf16 cache, :data:`TILES`,
    blocks of whole score tiles and heads of whole 32-value chunks."""
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    return (
        TILES
        and query.dtype == torch.bfloat16
        and block_size % POSITIONS == 0
        and head_dim % VALUES == 0
    )


def _usable(query, k_cache, v_cache) -> bool:
    return (
        numba is not None
        and query.device.type == "cpu"
        and query.dtype == k_cache.dtype == v_cache.dtype
        and query.dtype in DTYPES
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


@dataclass
class _Plan:
    """One batch's split and the row kernel's arrays, built from its metadata
    once and reused by every layer: ``inputs`` are the metadata tensors it was
    built from, ``versions`` their in-place modification counters then."""

    inputs: tuple
    versions: tuple | None
    pieces: reference.Pieces
    rows: tuple | None  # (tables, table_of, lengths, rows) for the row kernel
    # each row's first position under a window (None: no window), as the layers ask
    starts: dict = field(default_factory=dict)
    # the AMX kernel's arrays for the long pieces and its scratch, by head size
    amx: dict = field(default_factory=dict)
    # what :func:`.cpu_ops.rotary_store_attend` read from the step's positions and
    # slot mapping, checked once: (positions, slot_mapping, their versions or None,
    # their arrays)
    rope: tuple | None = None


_last_plan: list[_Plan | None] = [None]  # the plan of the batch the layers last attended


def _plan(num_tokens, num_heads, block_size, block_tables, seq_lens, query_start_loc) -> _Plan:
    """The last plan when called again with the same metadata tensors, unchanged
    since (the next layer of the same forward), else a new one. The plan holds its
    tensors, so an identity check cannot match a new tensor at a freed address."""
    inputs = (block_tables, seq_lens, query_start_loc, num_tokens, num_heads, block_size)
    last = _reused_plan(inputs)
    if last is not None:
        return last
    if any(t.is_inference() for t in inputs[:3]):  # no version counter: never reused
        versions = None
    else:
        versions = (block_tables._version, seq_lens._version, query_start_loc._version)
    pieces = reference.split_pieces(num_tokens, block_size, block_tables, seq_lens,
                                    query_start_loc, SHORT_PIECE_WORK // num_heads)  # fmt: skip
    plan = _Plan(
        inputs, versions, pieces, _row_arrays(block_tables, pieces) if pieces.together else None
    )
    _last_plan[0] = plan
    return plan


def _reused_plan(inputs: tuple) -> _Plan | None:
    """The last plan if it was built from ``inputs`` (metadata tensors, then the
    token, head and block counts) and the tensors are unchanged since, else None."""
    last = _last_plan[0]
    if (
        last is None
        or last.versions is None
        or not all(x is y for x, y in zip(last.inputs, inputs[:3]))
        or last.inputs[3:] != inputs[3:]
    ):
        return None
    block_tables, seq_lens, query_start_loc = inputs[:3]
    versions = (block_tables._version, seq_lens._version, query_start_loc._version)
    return last if versions == last.versions else None


def _piece_arrays(block_tables, pieces: reference.Pieces, seqs) -> tuple:
    """For the pieces of sequences ``seqs``, as int64 arrays: their block tables,
    their first rows in the batch, their query lengths and their sequences'
    lengths."""
    starts = pieces.starts
    tables = block_tables.index_select(0, torch.tensor(seqs, dtype=torch.int64))
    return (
        tables.to(torch.int64).numpy(),
        np.array([starts[s] for s in seqs], dtype=np.int64),
        np.array([starts[s + 1] - starts[s] for s in seqs], dtype=np.int64),
        np.array([pieces.lens[s] for s in seqs], dtype=np.int64),
    )


def _row_arrays(block_tables, pieces: reference.Pieces) -> tuple:
    """Every query row of ``pieces.together`` for the kernel: its sequence's table,
    its row in the batch and how many positions it sees (row ``i`` of a piece of
    ``q_len`` rows: the first ``seq_len - q_len + i + 1``)."""
    seqs = pieces.together
    tables, first, q_lens, seq_lens = _piece_arrays(block_tables, pieces, seqs)
    if int(q_lens.max()) == 1:  # decode rows only, one per sequence
        return tables, np.arange(len(seqs), dtype=np.int64), seq_lens, first
    table_of = np.repeat(np.arange(len(seqs), dtype=np.int64), q_lens)
    # each row's index within its piece
    within = np.arange(len(table_of), dtype=np.int64) - np.repeat(
        np.cumsum(q_lens) - q_lens, q_lens
    )
    return tables, table_of, (seq_lens - q_lens)[table_of] + within + 1, first[table_of] + within


def attend_long_pieces(query, k_cache, v_cache, block_tables, pieces: reference.Pieces, scale):
    """An output with the rows of ``pieces.long`` attended by torch's CPU flash
    attention, the other rows left for the row kernel to write (unset). Each
    piece reads its K and V as ``[seq_len, kv_heads, head_dim]``: a view of the
    cache where its blocks are consecutive (the allocator hands a sequence
    consecutive blocks), else its blocks gathered (one copy of what it reads). Its
    rows see the positions up to their own: causal from the corner when the piece
    starts the sequence, else through a mask (row ``i`` of a piece after
    ``context`` cached positions sees positions ``0..context + i``)."""
    out = torch.empty(query.shape, dtype=query.dtype)  # [num_tokens, num_heads, head_dim]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    for s in pieces.long:
        q_begin, q_end, seq_len = pieces.starts[s], pieces.starts[s + 1], pieces.lens[s]
        q_len = q_end - q_begin
        ids = block_tables[s, : blocks_for(seq_len, block_size)].tolist()
        if ids == list(range(ids[0], ids[0] + len(ids))):
            k = k_cache[ids[0] : ids[0] + len(ids)].reshape(-1, num_kv_heads, head_dim)
            v = v_cache[ids[0] : ids[0] + len(ids)].reshape(-1, num_kv_heads, head_dim)
        else:
            blocks = torch.tensor(ids, dtype=torch.int64)
            k = reference._gather_blocks(k_cache, blocks).view(-1, num_kv_heads, head_dim)
            v = reference._gather_blocks(v_cache, blocks).view(-1, num_kv_heads, head_dim)
        # [1, kv_heads, seq_len, head_dim] views
        k, v = k[:seq_len].transpose(0, 1)[None], v[:seq_len].transpose(0, 1)[None]
        q = query[q_begin:q_end].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
        context = seq_len - q_len
        mask = None
        if context:
            positions = torch.arange(seq_len)
            mask = positions[None, :] <= context + positions[:q_len, None]  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=not context, scale=scale, enable_gqa=True
        )  # [1, num_heads, q_len, head_dim]
        out[q_begin:q_end] = o[0].transpose(0, 1)
    return out


def _amx_arrays(plan: _Plan, block_tables, head_dim: int) -> tuple:
    """The long pieces' tables, first rows, query lengths and sequence lengths for
    :func:`.cpu_amx.attend_pieces`, and its scratch: made once a plan (every
    layer of a batch attends the same pieces)."""
    arrays = plan.amx.get(head_dim)
    if arrays is None:
        pieces = _piece_arrays(block_tables, plan.pieces, plan.pieces.long)
        arrays = (*pieces, cpu_amx.scratch(int(pieces[3].max()), head_dim))
        plan.amx[head_dim] = arrays
    return arrays


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
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
    """:func:`reference.paged_attention`, its decode rows and short prefill pieces
    on the compiled kernel where it applies (fp32 or bf16 on the CPU); under a
    soft cap, or a sliding window shorter than the longest sequence, on its
    variant for those (:func:`_paged_attention_window_cap`)."""
    if not _usable(query, k_cache, v_cache):
        return reference.paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                         query_start_loc, scale, window=window, soft_cap=soft_cap)  # fmt: skip
    cuts = window is not None and (max_seq_len is None or max_seq_len > window)
    if cuts or soft_cap is not None:
        return _paged_attention_window_cap(query, k_cache, v_cache, block_tables, seq_lens,
                                           query_start_loc, scale, window, soft_cap)  # fmt: skip
    checks.check_paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
    )
    plan = _plan(query.shape[0], query.shape[1], k_cache.shape[1], block_tables, seq_lens,
                 query_start_loc)  # fmt: skip
    if plan.pieces.long and _amx_applies(query):
        out = torch.empty(query.shape, dtype=query.dtype)
        tables, begins, q_lens, seq_lens, scratch = _amx_arrays(plan, block_tables, query.shape[2])
        k_words = as_array(k_cache).view(np.uint32)  # pairs of bf16
        cpu_amx.attend_pieces(as_array(query), k_words, as_array(v_cache), tables, begins, q_lens,
                              seq_lens, np.float32(scale), as_array(out), *scratch)  # fmt: skip
    elif plan.pieces.long:
        out = attend_long_pieces(query, k_cache, v_cache, block_tables, plan.pieces, scale)
    else:  # every row is the row kernel's to write
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if plan.rows is not None:
        tables, table_of, lengths, rows = plan.rows
        threads = torch.get_num_threads()
        parallel = threads > 1 and len(rows) > 1
        if parallel:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        arrays = (as_array(query.contiguous()), as_array(k_cache), as_array(v_cache), tables,
                  table_of)  # fmt: skip
        if _tiles_apply(query, k_cache):
            (_attend_all_parallel_tiles if parallel else _attend_all_tiles)(
                *arrays, _row_starts(plan, None), lengths, rows, np.float32(scale),
                np.float32(0.0), as_array(out), _amx_groups_apply(query, k_cache),
            )  # fmt: skip
        else:
            (_attend_all_parallel if parallel else _attend_all)(
                *arrays, lengths, rows, np.float32(scale), as_array(out)
            )
    return out


def _row_starts(plan: _Plan, window: int | None) -> np.ndarray:
    """Each row's first position in reach under ``window`` (the last ``window``
    it sees; 0 without one), computed once a plan and window."""
    starts = plan.starts.get(window)
    if starts is None:
        _, _, lengths, _ = plan.rows
        starts = np.zeros_like(lengths) if window is None else np.maximum(lengths - window, 0)
        plan.starts[window] = starts
    return starts


def _paged_attention_window_cap(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                scale, window, soft_cap) -> torch.Tensor:  # fmt: skip
    """:func:`paged_attention` under a soft cap or a window that cuts: decode rows
    and short prefill pieces on the kernel's window/cap variant, each row
    starting at its window's first position; long pieces as the reference
    attends them (torch's flash attention takes neither a cap nor, without a
    mask of every row, a window)."""
    checks.check_paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window, soft_cap
    )
    plan = _plan(query.shape[0], query.shape[1], k_cache.shape[1], block_tables, seq_lens,
                 query_start_loc)  # fmt: skip
    out = reference.attend_long_pieces(query, k_cache, v_cache, block_tables, plan.pieces, scale,
                                       window, soft_cap)  # fmt: skip
    if plan.rows is not None:
        tables, table_of, lengths, rows = plan.rows
        starts = _row_starts(plan, window)
        threads = torch.get_num_threads()
        parallel = threads > 1 and len(rows) > 1
        if parallel:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        if _tiles_apply(query, k_cache):
            kernel = _attend_all_parallel_tiles if parallel else _attend_all_tiles
            amx = (_amx_groups_apply(query, k_cache),)  # the tiles' one argument more
        else:
            kernel = _attend_all_parallel_window_cap if parallel else _attend_all_window_cap
            amx = ()
        kernel(
            as_array(query.contiguous()), as_array(k_cache), as_array(v_cache), tables,
            table_of, starts, lengths, rows, np.float32(scale),
            np.float32(0.0 if soft_cap is None else soft_cap), as_array(out), *amx,
        )  # fmt: skip
    return out
