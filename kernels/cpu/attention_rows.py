"""The row kernels of the CPU paged attention: decode rows and short prefill pieces.

Each query row reads its sequence's KV blocks where they lie in the paged cache,
once and in order, every query head of the row sharing that read, in a softmax of
known length (no padding, no masking). At 128 decode rows of the demo model, ~100
positions each, a layer's KV (13 MB) no longer fits the caches, so a row kernel
is bound by memory: a block's 8 KiB arrive as the hardware prefetcher starts
over on each block, so the kernels ask for the blocks ahead of the one they read
(:data:`PREFETCH_BLOCKS`), and take the softmax's exponentials in vector
registers (:func:`.fastmath.exp_f32`).

Two kernels, chosen by :mod:`.dispatch`:

- **loops** (:func:`_attend_row`): any head size, fp32 or bf16 (a bf16 cache is
  read as fp32 as it streams past, :mod:`.fastmath`); the inner loops run over
  1-D rows of a head's values and vectorize.
- **tiles** (:func:`_attend_row_tiles`): bf16 on CPUs with AVX-512 BF16, blocks
  of a multiple of 16 slots and heads of a multiple of 32 values; its products
  are register tiles (:mod:`.tiles`): a block's 16 positions against one query
  head are one score tile, a run of positions into up to 8 heads' accumulators
  one PV tile. On AMX CPUs (``amx``, not None: its scratch) the scores of a KV
  head's group of query heads come from one AMX product a 16-position tile
  (:func:`.amx.group_scores`).

A sliding window and a soft cap are compile-time specialisations of both, not
copies: ``starts`` (each row's first position in reach) is None without a
window that cuts, ``soft_cap`` None without a cap, and numba compiles a variant
for each combination of types, the branches of the others pruned. A row then
reads positions ``start..length - 1`` only (the blocks before its window are
never read; the scheduler may have handed them on), each scaled score capped as
``soft_cap * tanh(score / soft_cap)`` in the softmax pass (tanh is increasing,
so the largest raw score, capped, is the largest capped one).

Each kernel has two entry points: the rows one after the other, or (more than
one torch thread) split across numba's threads.
"""

from __future__ import annotations

import numpy as np

from . import amx as cpu_amx
from .fastmath import exp_f32, load_f32, prefetch_l2, store_f32, tanh_f32
from .jit import jit, prange
from .tiles import HEADS, POSITIONS, VALUES, pv_tile, qk_tile, spread_scores

# How many KV blocks ahead of the one being read a row asks for (fastmath.prefetch_l2):
# one block takes about as long to arrive as two to compute with.
PREFETCH_BLOCKS = 2


@jit()
def _prefetch_block(rows, block, rows_per_block, head_dim):
    first = block * rows_per_block * head_dim
    for line in range(0, rows_per_block * head_dim, 64 // rows.itemsize):  # a 64-byte line
        prefetch_l2(rows, first + line)


@jit()
def _prefetch_slice(rows, block, per_block, head_dim, part, parts):
    """Slice ``part`` of ``parts`` of :func:`_prefetch_block`'s lines: the tiles fetch
    the blocks ahead a slice per tile, spread over the block being read; asked for
    in one burst, a block's 128 lines fill the core's miss queue and the tiles
    stall behind them (0.55 against 0.48 ms a layer at 32 rows over 160
    positions, one core)."""
    step = 64 // rows.itemsize
    lines = per_block * head_dim // step
    first = block * per_block * head_dim
    for line in range(part * lines // parts, (part + 1) * lines // parts):
        prefetch_l2(rows, first + line * step)


@jit()
def _start(starts, r):
    """Row ``r``'s first position in reach: 0 without a window (``starts`` None)."""
    return 0 if starts is None else starts[r]


@jit()
def _row(tables, table_of, starts, lengths, r):
    """Row ``r``'s table, first position and length, and those of the row after it
    (length 0 after the last row): a row prefetches the next one's first blocks."""
    n = lengths.shape[0]
    following = min(r + 1, n - 1)
    return (
        tables[table_of[r]], _start(starts, r), lengths[r],
        tables[table_of[following]], _start(starts, following),
        lengths[following] if r + 1 < n else 0,
    )  # fmt: skip


@jit()
def _softmax(head_scores, count, largest, soft_cap):
    """``head_scores[:count]`` replaced by their exponentials less the largest
    (capped first when ``soft_cap`` is not None); returns the normaliser 1 / sum."""
    total = np.float32(0.0)
    if soft_cap is not None:
        inv_cap = np.float32(1.0) / soft_cap
        top = soft_cap * tanh_f32(largest * inv_cap)
        for p in range(count):
            e = exp_f32(soft_cap * tanh_f32(head_scores[p] * inv_cap) - top)
            head_scores[p] = e
            total += e
    else:
        for p in range(count):
            e = exp_f32(head_scores[p] - largest)
            head_scores[p] = e
            total += e
    return np.float32(1.0) / total


@jit()
def _attend_row(
    q, k_rows, v_rows, tables, table_of, starts, lengths, rows, r, scale, soft_cap, out,
    scores, acc, qh, top, block_size, num_kv_heads,
):  # fmt: skip
    """Row ``r`` of the batch on the loops, every query head at once: each block of
    K, then of V, is read once, front to back (a position's KV heads lie side by
    side), so the cache is streamed rather than revisited. ``k_rows``/``v_rows`` are
    the caches as ``[slot * num_kv_heads + head, head_dim]``; ``scores``, ``acc``,
    ``qh`` and ``top`` are scratch of ``[num_heads, ...]``, scores indexed from the
    row's first position. Each head's largest score is kept as the scores are made
    (a separate pass does not vectorize: numba's max reduction stays scalar), and
    the softmax's division is left to the output row. While a block is read, the
    one :data:`PREFETCH_BLOCKS` further along this row's K blocks, then its V
    blocks, then the next row's K blocks is fetched into L2."""
    table, start, length, next_table, next_start, next_length = _row(
        tables, table_of, starts, lengths, r
    )
    row = rows[r]
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
    for i in range(num_heads):  # from here on, top[i] is the head's normaliser
        top[i] = _softmax(scores[i], length - start, top[i], soft_cap)
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


@jit()
def _attend_row_tiles(
    q, k_flat, v_flat, tables, table_of, starts, lengths, rows, r, scale, soft_cap, out,
    scores, acc, top, block_size, num_kv_heads, amx, packed, tile, config,
):  # fmt: skip
    """:func:`_attend_row` in tiles. ``k_flat``/``v_flat`` are the caches' bits as
    1-D arrays; ``scores`` is ``[num_heads, longest rounded up to a block]``, indexed
    from the first slot of the block holding the row's first position (a score
    tile writes all 16 of its positions; the ones past ``length`` from whatever
    their slots hold, which nothing reads). Score tiles start at 16-slot
    boundaries, so under a window the slots of the first tile before it are scored
    too and then left out of the largest score, the softmax and the PV tiles.
    With ``amx`` not None the scores come from :func:`.amx.group_scores`, whose
    scratch are ``packed`` (the query), ``tile`` and ``config``."""
    table, start, length, next_table, next_start, next_length = _row(
        tables, table_of, starts, lengths, r
    )
    row = rows[r]
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    if amx is not None:
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
                # a slice of the blocks ahead a tile: a KV head's (AMX) or a query head's
                parts, at = (num_kv_heads, h) if amx is not None else (num_heads, h * group)
                for i in range(h * group, (h + 1) * group if amx is None else h * group + 1):
                    if o == 0 and ahead < num_blocks:
                        _prefetch_slice(k_flat, table[first_block + ahead], per_block, head_dim,
                                        at + i - h * group, parts)  # fmt: skip
                    elif o == 0 and ahead < 2 * num_blocks:
                        _prefetch_slice(v_flat, table[first_block + ahead - num_blocks], per_block,
                                        head_dim, at + i - h * group, parts)  # fmt: skip
                    if amx is not None:
                        cpu_amx.group_scores(k_flat, k_at, stride * 2, packed, h, chunks, group,
                                             tile)  # fmt: skip
                        spread_scores(group, tile, scale, s_flat,
                                      h * group * width + jj * block_size + o, width, top,
                                      h * group, lowest, valid)  # fmt: skip
                    else:
                        largest = qk_tile(q_flat, q_row + i * head_dim, k_flat, k_at, stride,
                                          chunks, scale, s_flat, i * width + jj * block_size + o,
                                          lowest, valid)  # fmt: skip
                        top[i] = max(top[i], largest)
    if amx is not None:
        cpu_amx.release_tiles()
    for i in range(num_heads):
        # a view from the window's first slot: a loop from a nonzero start does not
        # vectorize (the softmax took as long as the rest of the kernel)
        top[i] = _softmax(scores[i, skip:count], count - skip, top[i], soft_cap)
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


@jit()
def _width(starts, lengths, r, block):
    """The score slots row ``r`` needs: its positions from the start of the
    ``block``-slot run holding its first one, rounded up to whole runs (``block``
    1 for the loops; a KV block for the tiles, whose score tiles write 16 slots)."""
    first = _start(starts, r) // block * block
    return (max(lengths[r] - first, 1) + block - 1) // block * block


@jit()
def _widest(starts, lengths, block):
    """:func:`_width` of the row that needs the most."""
    widest = block
    for r in range(lengths.shape[0]):
        widest = max(widest, _width(starts, lengths, r, block))
    return widest


@jit()
def _first_blocks(k_cache, tables, table_of, starts, lengths):
    """Fetches the first row's first blocks; every later row's come with the row
    before it."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if lengths.shape[0]:
        first = _start(starts, 0) // block_size
        for j in range(min(PREFETCH_BLOCKS, (lengths[0] + block_size - 1) // block_size - first)):
            _prefetch_block(k_cache.reshape(-1), tables[table_of[0], first + j],
                            block_size * num_kv_heads, head_dim)  # fmt: skip


@jit()
def _loops_scratch(q, width):
    """A thread's scratch for :func:`_attend_row`: scores ``width`` a head, the
    accumulators, the scaled query, each head's largest score."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    return (
        np.empty((num_heads, width), dtype=np.float32),
        np.empty((num_heads, head_dim), dtype=np.float32),
        np.empty((num_heads, head_dim), dtype=np.float32),
        np.empty(num_heads, dtype=np.float32),
    )


@jit()
def _loops_row(q, k_cache, v_cache, tables, table_of, starts, lengths, rows, r, scale, soft_cap,
               out, scratch):  # fmt: skip
    head_dim = q.shape[2]
    scores, acc, qh, top = scratch
    _attend_row(q, k_cache.reshape(-1, head_dim), v_cache.reshape(-1, head_dim), tables,
                table_of, starts, lengths, rows, r, scale, soft_cap, out, scores, acc, qh, top,
                k_cache.shape[1], k_cache.shape[2])  # fmt: skip


@jit()
def _tiles_scratch(q, k_cache, width):
    """A thread's scratch for :func:`_attend_row_tiles`: scores ``width`` a head, the
    accumulators, each head's largest score, and the AMX scores' (packed query,
    score tile, tile configuration: a few hundred bytes, made whether used or not)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    return (
        np.empty((num_heads, width), dtype=np.float32),
        np.empty((num_heads, head_dim), dtype=np.float32),
        np.empty(num_heads, dtype=np.float32),
        np.empty(num_heads * head_dim // 2, dtype=np.uint32),
        np.empty(POSITIONS * (num_heads // k_cache.shape[2]), dtype=np.float32),
        np.empty(64, dtype=np.uint8),
    )


@jit()
def _tiles_row(q, k_cache, v_cache, tables, table_of, starts, lengths, rows, r, scale, soft_cap,
               out, scratch, amx):  # fmt: skip
    scores, acc, top, packed, tile, config = scratch
    _attend_row_tiles(q, k_cache.reshape(-1), v_cache.reshape(-1), tables, table_of, starts,
                      lengths, rows, r, scale, soft_cap, out, scores, acc, top, k_cache.shape[1],
                      k_cache.shape[2], amx, packed, tile, config)  # fmt: skip


# The entry points: the rows one after the other, or across numba's threads (each
# thread with scratch of its own). Row ``r`` of a batch is query row ``rows[r]``,
# seeing positions ``starts[r]`` (0 when ``starts`` is None) to ``lengths[r] - 1`` of
# the sequence whose table is ``tables[table_of[r]]``. The kernel is the loops with
# ``tiles`` None, else the tiles; with ``amx`` not None their scores are AMX's. Each
# combination is compiled on its own (None is a type of its own to numba), the
# others' code pruned. Inside a prange loop numba hands the body what it reads from
# outside as optional values, so there a branch on ``x is None`` is compiled both
# ways and runs as a branch: the choice between the kernels, whose scratch differs,
# is made before the loops.


@jit()
def attend_rows(q, k_cache, v_cache, tables, table_of, starts, lengths, rows, scale, soft_cap,
                out, tiles, amx):  # fmt: skip
    _first_blocks(k_cache, tables, table_of, starts, lengths)
    if tiles is None:
        scratch = _loops_scratch(q, _widest(starts, lengths, 1))
        for r in range(lengths.shape[0]):
            _loops_row(q, k_cache, v_cache, tables, table_of, starts, lengths, rows, r, scale,
                       soft_cap, out, scratch)  # fmt: skip
    else:
        tiled = _tiles_scratch(q, k_cache, _widest(starts, lengths, k_cache.shape[1]))
        for r in range(lengths.shape[0]):
            _tiles_row(q, k_cache, v_cache, tables, table_of, starts, lengths, rows, r, scale,
                       soft_cap, out, tiled, amx)  # fmt: skip


@jit(parallel=True)
def attend_rows_parallel(q, k_cache, v_cache, tables, table_of, starts, lengths, rows, scale,
                         soft_cap, out, tiles, amx):  # fmt: skip
    if tiles is None:
        for r in prange(lengths.shape[0]):
            scratch = _loops_scratch(q, _width(starts, lengths, r, 1))
            _loops_row(q, k_cache, v_cache, tables, table_of, starts, lengths, rows, r, scale,
                       soft_cap, out, scratch)  # fmt: skip
    else:
        for r in prange(lengths.shape[0]):
            tiled = _tiles_scratch(q, k_cache, _width(starts, lengths, r, k_cache.shape[1]))
            _tiles_row(q, k_cache, v_cache, tables, table_of, starts, lengths, rows, r, scale,
                       soft_cap, out, tiled, amx)  # fmt: skip
