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

    a:     [slots, T * rmax, in]   A of target t of the product: rows t * rmax + q
    b:     [slots, rmax, width]    B^T of the target owning each output column
    ranks: [slots, T]              each slot's rank per target (0: not adapted)
    cols:  [T + 1]                 the bounds of each target's output columns

for the ``T`` targets fused into the product (q, k, v; gate, up; or one).
Rows past a slot's rank are never read, so ranks below ``rmax`` cost nothing.
Rows go :data:`TILE` at a time (a "tile", one weight row read for four dot
products); a tile's spare rows repeat its last row and are not written.

fp32 and bf16 (a bf16 tensor read and written as its bits, :mod:`.cpu_math`);
``out`` is rounded once, after its delta is added. Compiled on first use (a few
seconds) and cached on disk; with more than one torch thread the tiles are split
across numba's threads.
"""

from __future__ import annotations

import numpy as np
import torch

from .cpu_attention import _jit, numba, prange
from .cpu_math import as_array, load_f32, store_f32

TILE = 4
DTYPES = (torch.float32, torch.bfloat16)


def available(dtype: torch.dtype) -> bool:
    """Whether the compiled kernel serves tensors of ``dtype`` here."""
    return numba is not None and dtype in DTYPES


def tiles(segments: list[tuple[int, int, int]]) -> np.ndarray:
    """``[num_tiles, 3]`` (slot, first row, end row) of each tile of at most
    :data:`TILE` rows of the ``(slot, start, end)`` segments (slots as indices
    of the weights' first dimension)."""
    out = [(slot, row, min(row + TILE, end)) for slot, start, end in segments
           for row in range(start, end, TILE)]  # fmt: skip
    return np.array(out, dtype=np.int64).reshape(-1, 3)


@_jit()
def _shrink_expand(x, out, a, b, ranks, tile, cols, rmax):
    """One tile: ``out[rows, c] += sum_q (x[rows] . a[slot, t*rmax+q]) b[slot, q, c]``
    for the target ``t`` owning column ``c``."""
    slot, first, end = tile[0], tile[1], tile[2]
    n = end - first
    num_in = a.shape[2]
    num_targets = cols.shape[0] - 1
    width = b.shape[2]
    # The tile's rows in fp32, once (each is read once per rank of each target).
    xs = np.empty((TILE, num_in), dtype=np.float32)
    for i in range(TILE):
        row = x[first + min(i, n - 1)]
        for k in range(num_in):
            xs[i, k] = load_f32(row, k)
    x0, x1, x2, x3 = xs[0], xs[1], xs[2], xs[3]
    acc = np.zeros((TILE, width), dtype=np.float32)
    acc0, acc1, acc2, acc3 = acc[0], acc[1], acc[2], acc[3]
    w_row = np.empty(width, dtype=np.float32)
    for t in range(num_targets):
        c0, c1 = cols[t], cols[t + 1]
        for q in range(ranks[slot, t]):
            w_in = a[slot, t * rmax + q]
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for k in range(num_in):
                w = load_f32(w_in, k)
                s0 += x0[k] * w
                s1 += x1[k] * w
                s2 += x2[k] * w
                s3 += x3[k] * w
            # One row of B^T in fp32, then one loop per output row: a loop with a
            # single output stream vectorizes (four would need more run-time
            # alias checks than LLVM makes). Indices count from 0, which numba
            # knows need no wraparound.
            w_out, w = b[slot, q, c0:c1], w_row[: c1 - c0]
            for c in range(c1 - c0):
                w[c] = load_f32(w_out, c)
            for acc_i, s_i in ((acc0, s0), (acc1, s1), (acc2, s2), (acc3, s3)):
                part = acc_i[c0:c1]
                for c in range(c1 - c0):
                    part[c] += s_i * w[c]
    for i in range(n):
        row, delta = out[first + i], acc[i]
        for c in range(width):
            store_f32(row, c, load_f32(row, c) + delta[c])


@_jit()
def _add_serial(x, out, a, b, ranks, tiles, cols, rmax):
    for i in range(tiles.shape[0]):
        _shrink_expand(x, out, a, b, ranks, tiles[i], cols, rmax)


@_jit(parallel=True)
def _add_parallel(x, out, a, b, ranks, tiles, cols, rmax):
    for i in prange(tiles.shape[0]):
        _shrink_expand(x, out, a, b, ranks, tiles[i], cols, rmax)


def lora_add(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             ranks: np.ndarray, tiles: np.ndarray, cols: np.ndarray, rmax: int,
             threads: int = 1) -> torch.Tensor:  # fmt: skip
    """Adds every tile's LoRA delta to ``out`` (in place; see the module
    docstring for the layout of ``a``, ``b``, ``cols``); returns ``out``."""
    if not x.is_contiguous():
        x = x.contiguous()
    if threads > 1 and len(tiles) > 1:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        fn = _add_parallel
    else:
        fn = _add_serial
    fn(as_array(x), as_array(out), as_array(a), as_array(b), ranks, tiles, cols, rmax)
    return out
