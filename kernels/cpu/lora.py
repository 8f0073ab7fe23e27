"""LoRA shrink and expand of a CPU step in one compiled call per product.

A step's adapted rows add ``(x[seg] @ At_slot) @ Bt_slot`` to each product's
output, per adapter segment (:mod:`.lora`). On a CPU these products are tiny (a
rank-16 adapter of the demo model: 0.3–1.4 M multiply-adds per product at 64
rows) and torch's calls cost more than their arithmetic: a batched bf16
``bmm`` runs ~6 µs in oneDNN but ~20 µs through torch, and ~50 µs inside a
decode step, where each call finds its code and buffers evicted by the layer
before it. This kernel does a product's shrink and expand for every segment of
the step in one call, reading ``x`` and adding into ``out`` where they lie, in
fp32 sums, with no zero blocks, over the adapter slots' weights laid out as

    a:     [slots, T, in, rpad]    A^T of target t: row k holds input k's weight
                                   for each rank, padded to rpad (RANK_LANES | rpad)
    b:     [slots, rmax, width]    B^T of the target owning each output column
    ranks: [slots, T]              each slot's rank per target (0: not adapted)
    cols:  [T + 1]                 the bounds of each target's output columns

for the ``T`` targets fused into the product (q, k, v; gate, up; or one).
Rows go :data:`TILE` at a time (a "tile"). Both halves are register tiles
(:func:`.cpu_tiles.rows16_tile`, :func:`.cpu_tiles.pv_tile`): the shrink keeps
the tile's rows × 16 ranks of sums in vector registers while it runs down the
inputs (one A row read, widened and multiplied into every row of the tile); the
expand keeps the rows × 32 output columns, read from ``out`` and written back
once, while it runs down the ranks. Lanes past a target's rank are computed
from whatever the padding holds and never read; output columns past the last
multiple of 32 of a target go through a plain loop. B rows past a slot's rank
are never read, so ranks below ``rmax`` (``b``'s second dimension) cost only
their padding to 16.

The kernel this replaced read A by rank, ending every dot product in a
horizontal sum: 77 → ~30 µs for the demo model's q/k/v product at 64 rows of
four rank-16 adapters (docs/kernels.md).

fp32 and bf16 (a bf16 tensor read and written as its bits, :mod:`.cpu_math`);
``out`` is rounded once, after its delta is added; its rows must be contiguous.
Compiled on first use (a few seconds) and cached on disk; with more than one
torch thread the tiles are split across numba's threads.
"""

from __future__ import annotations

import numpy as np
import torch

from .fastmath import as_array, load_f32, store_f32
from .jit import jit, numba, prange

if numba is not None:
    from .tiles import ROWS, VALUES, pv_tile, rows16_tile

    TILE = ROWS
else:  # pragma: no cover - numba is a dependency
    TILE = 4
DTYPES = (torch.float32, torch.bfloat16)
# A's rank dimension is padded to a multiple of this (one vector of fp32 sums).
RANK_LANES = 16


def available(dtype: torch.dtype) -> bool:
    """Whether the compiled kernel serves tensors of ``dtype`` here."""
    return numba is not None and dtype in DTYPES


def padded_rank(rmax: int) -> int:
    """The rank dimension of the ``a`` layout for ranks up to ``rmax``."""
    return -(-rmax // RANK_LANES) * RANK_LANES


def tiles(segments: list[tuple[int, int, int]]) -> np.ndarray:
    """``[num_tiles, 3]`` (slot, first row, end row) of each tile of at most
    :data:`TILE` rows of the ``(slot, start, end)`` segments (slots as indices
    of the weights' first dimension)."""
    out = [(slot, row, min(row + TILE, end)) for slot, start, end in segments
           for row in range(start, end, TILE)]  # fmt: skip
    return np.array(out, dtype=np.int64).reshape(-1, 3)


@jit()
def _shrink_expand(x, out, a, b, ranks, tile, cols):
    """One tile: ``out[rows, c] += sum_q (x[rows] . a[slot, t, :, q]) b[slot, q, c]``
    for the target ``t`` owning column ``c`` (each column is one target's: its
    sum is added to ``out`` and rounded once)."""
    slot, first, end = tile[0], tile[1], tile[2]
    n = end - first
    num_targets, num_in, rpad = a.shape[1], a.shape[2], a.shape[3]
    rmax, width = b.shape[1], b.shape[2]
    out_stride = out.strides[0] // out.itemsize
    # The tile's rows in fp32, once (each is read once per 16 ranks of each target).
    xs = np.empty((TILE, num_in), dtype=np.float32)
    for i in range(n):
        row, wide = x[first + i], xs[i]
        for k in range(num_in):
            wide[k] = load_f32(row, k)
    shrunk = np.empty((TILE, rpad), dtype=np.float32)
    for t in range(num_targets):
        rank = ranks[slot, t]
        if rank == 0:
            continue
        shrunk[:] = 0.0
        a_at = ((slot * num_targets + t) * num_in) * rpad
        for q in range(0, rank, RANK_LANES):
            rows16_tile(n, shrunk, q, rpad, a, a_at + q, rpad, xs, 0, num_in, num_in)
        c0, c1 = cols[t], cols[t + 1]
        b_at = slot * rmax * width
        c = c0
        while c + VALUES <= c1:
            pv_tile(n, out, first * out_stride + c, out_stride, b, b_at + c, width, shrunk, 0,
                    rpad, rank)  # fmt: skip
            c += VALUES
        for i in range(n):  # the columns past the last whole tile
            row, s_i = out[first + i], shrunk[i]
            for cc in range(c, c1):
                total = np.float32(0.0)
                for q in range(rank):
                    total += s_i[q] * load_f32(b[slot, q], cc)
                store_f32(row, cc, load_f32(row, cc) + total)


@jit()
def _add_serial(x, out, a, b, ranks, tiles, cols):
    for i in range(tiles.shape[0]):
        _shrink_expand(x, out, a, b, ranks, tiles[i], cols)


@jit(parallel=True)
def _add_parallel(x, out, a, b, ranks, tiles, cols):
    for i in prange(tiles.shape[0]):
        _shrink_expand(x, out, a, b, ranks, tiles[i], cols)


def lora_add(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor | np.ndarray,
             b: torch.Tensor | np.ndarray, ranks: np.ndarray, tiles: np.ndarray,
             cols: np.ndarray, threads: int = 1) -> torch.Tensor:  # fmt: skip
    """Adds every tile's LoRA delta to ``out`` (in place; see the module
    docstring for the layout of ``a``, ``b``, ``cols``); returns ``out``. ``a``
    and ``b`` may be given as their :func:`.cpu_math.as_array` views already,
    made once for weights that stay (a call after a layer's products finds every
    conversion cold: ~5 µs each)."""
    if not x.is_contiguous():
        x = x.contiguous()
    if out.stride(1) != 1:
        raise ValueError("lora_add: out's rows must be contiguous")
    if threads > 1 and len(tiles) > 1:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        fn = _add_parallel
    else:
        fn = _add_serial
    if isinstance(a, torch.Tensor):
        a = as_array(a)
    if isinstance(b, torch.Tensor):
        b = as_array(b)
    fn(as_array(x), as_array(out), a, b, ranks, tiles, cols)
    return out
