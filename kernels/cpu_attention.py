"""Paged decode attention for CPU ranks, compiled with numba.

The torch reference attends a batch's decode rows by gathering every
sequence's KV blocks into one padded tensor and running batched matmuls of one
query row each: the gather copies the whole KV once more than attention reads
it, and each batch item is a separate tiny matmul. This kernel reads each
sequence's blocks where they lie in the paged cache, once and in order, every
query head sharing that read, in a softmax of known length (no padding, no
masking). At 128 decode rows of the demo model, ~100 positions each, a layer's
KV (13 MB) no longer fits the CPU's caches, so the kernel is bound by memory:
it streams it at about 11 GB/s, ~1.2 ms a layer against the reference's ~7 ms.

Only decode rows (one query row per sequence) run here; prefill pieces, whose
many rows make matmuls efficient, stay with the reference
(:func:`reference.attend_pieces`). fp32 caches only: numba has no fp16/bf16
arithmetic, so other dtypes take the reference path. With more than one torch
thread the sequences are split across numba's threads (as many as torch's).
The kernel is compiled on first use (about a second) and cached on disk.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from . import reference

logger = logging.getLogger(__name__)

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; degrade rather than fail
    numba = None

if numba is not None:
    # Compiled lazily, on the first call with each argument type; cached on disk.
    def _jit(parallel: bool = False):
        return numba.njit(
            parallel=parallel, fastmath=True, nogil=True, cache=True, boundscheck=False
        )

    prange = numba.prange
else:

    def _jit(parallel: bool = False):
        return lambda fn: fn

    prange = range


def available() -> bool:
    """Whether the compiled kernel can run here (numba imports)."""
    return numba is not None


@_jit()
def _attend_one(q, k_cache, v_cache, table, length, row, scale, out, scores, acc, qh):
    """One sequence's decode row, every query head at once: each block of K, then
    of V, is read once, front to back (a position's KV heads lie side by side), so
    the cache is streamed rather than revisited; the inner loops run over 1-D rows
    and vectorize. ``scores``, ``acc`` and ``qh`` are scratch of ``[num_heads, ...]``."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = (length + block_size - 1) // block_size
    for i in range(num_heads):
        for d in range(head_dim):
            qh[i, d] = q[row, i, d] * scale
            acc[i, d] = 0.0
    for j in range(num_blocks):
        block = k_cache[table[j]]
        for o in range(min(block_size, length - j * block_size)):
            for h in range(num_kv_heads):
                k_row = block[o, h]
                for g in range(group):
                    x = np.float32(0.0)
                    for d in range(head_dim):
                        x += qh[h * group + g, d] * k_row[d]
                    scores[h * group + g, j * block_size + o] = x
    for i in range(num_heads):
        top = scores[i, 0]
        for p in range(1, length):
            top = max(top, scores[i, p])
        total = np.float32(0.0)
        for p in range(length):
            e = math.exp(scores[i, p] - top)
            scores[i, p] = e
            total += e
        inv = np.float32(1.0) / total
        for p in range(length):
            scores[i, p] *= inv
    for j in range(num_blocks):
        block = v_cache[table[j]]
        for o in range(min(block_size, length - j * block_size)):
            p = j * block_size + o
            for h in range(num_kv_heads):
                v_row = block[o, h]
                for g in range(group):
                    w = scores[h * group + g, p]
                    for d in range(head_dim):
                        acc[h * group + g, d] += w * v_row[d]
    for i in range(num_heads):
        for d in range(head_dim):
            out[row, i, d] = acc[i, d]


@_jit()
def _attend_all(q, k_cache, v_cache, tables, lengths, rows, scale, out):
    num_heads, head_dim = q.shape[1], q.shape[2]
    longest = 1
    for s in range(lengths.shape[0]):
        longest = max(longest, lengths[s])
    scores = np.empty((num_heads, longest), dtype=np.float32)
    acc = np.empty((num_heads, head_dim), dtype=np.float32)
    qh = np.empty((num_heads, head_dim), dtype=np.float32)
    for s in range(lengths.shape[0]):
        _attend_one(
            q, k_cache, v_cache, tables[s], lengths[s], rows[s], scale, out, scores, acc, qh
        )


@_jit(parallel=True)
def _attend_all_parallel(q, k_cache, v_cache, tables, lengths, rows, scale, out):
    num_heads, head_dim = q.shape[1], q.shape[2]
    for s in prange(lengths.shape[0]):
        scores = np.empty((num_heads, max(lengths[s], 1)), dtype=np.float32)
        acc = np.empty((num_heads, head_dim), dtype=np.float32)
        qh = np.empty((num_heads, head_dim), dtype=np.float32)
        _attend_one(
            q, k_cache, v_cache, tables[s], lengths[s], rows[s], scale, out, scores, acc, qh
        )


def _attend_decodes(query, k_cache, v_cache, block_tables, seqs, starts, lens, scale, out):
    """The reference's decode hook, on the numba kernel where it applies."""
    usable = (
        numba is not None
        and query.device.type == "cpu"
        and query.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and out.is_contiguous()
    )
    if not usable:
        reference._attend_decodes(query, k_cache, v_cache, block_tables, seqs, starts, lens,
                                  scale, out)  # fmt: skip
        return
    index = torch.tensor(seqs, dtype=torch.int64)
    tables = block_tables.index_select(0, index).to(torch.int64).numpy()
    lengths = np.array([lens[s] for s in seqs], dtype=np.int64)
    rows = np.array([starts[s] for s in seqs], dtype=np.int64)
    threads = torch.get_num_threads()
    parallel = threads > 1 and len(seqs) > 1
    if parallel:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    (_attend_all_parallel if parallel else _attend_all)(
        query.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(), tables, lengths, rows,
        np.float32(scale), out.numpy(),
    )  # fmt: skip


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
) -> torch.Tensor:
    """:func:`reference.paged_attention`, its decode rows on the compiled kernel."""
    return reference.attend_pieces(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, _attend_decodes
    )
