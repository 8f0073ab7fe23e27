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
to its own (:data:`SHORT_PIECE_WORK`); long pieces, whose many rows make matrix
products efficient, stay with the reference (:func:`reference.attend_long_pieces`).
How a batch splits is read from its metadata once and reused by every layer
(:func:`_plan`). fp32 caches only: numba has no fp16/bf16 arithmetic, so other
dtypes take the reference path. With more than one torch thread the rows are
split across numba's threads (as many as torch's). The kernel is compiled on
first use (about a second) and cached on disk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from . import checks, reference
from .cpu_math import exp_f32, prefetch_l2

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


# A prefill piece of at most this many query rows x positions runs on the kernel
# too (a 256-token prompt: 65536). Measured on the demo model's heads, 8 pieces at
# once: 32 tokens 0.38 ms against the reference's 1.50 (whose per-piece gathers
# and matmuls are mostly dispatch), 256 tokens 1.9 against 2.6; at 1024 tokens
# the two are even, and the reference's matrix products scale better with heads.
SHORT_PIECE_WORK = 1 << 16


def available() -> bool:
    """Whether the compiled kernel can run here (numba imports)."""
    return numba is not None


# How many KV blocks ahead of the one being read a row asks for (cpu_math.prefetch_l2):
# one block takes about as long to arrive as two to compute with.
PREFETCH_BLOCKS = 2


@_jit()
def _prefetch_block(rows, block, rows_per_block, head_dim):
    first = block * rows_per_block * head_dim
    for line in range(0, rows_per_block * head_dim, 16):  # 16 fp32 in a 64-byte line
        prefetch_l2(rows, first + line)


@_jit()
def _attend_one(
    q, k_rows, v_rows, table, length, next_table, next_length, row, scale, out,
    scores, acc, qh, block_size, num_kv_heads,
):  # fmt: skip
    """One sequence's decode row, every query head at once: each block of K, then
    of V, is read once, front to back (a position's KV heads lie side by side), so
    the cache is streamed rather than revisited; the inner loops run over 1-D rows
    and vectorize. ``k_rows``/``v_rows`` are the caches as ``[slot * num_kv_heads
    + head, head_dim]``; ``scores``, ``acc`` and ``qh`` are scratch of
    ``[num_heads, ...]``. While a block is read, the one :data:`PREFETCH_BLOCKS`
    further along this row's K blocks, then its V blocks, then the next row's K
    blocks (``next_table``, ``next_length``) is fetched into L2."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = (length + block_size - 1) // block_size
    next_blocks = (next_length + block_size - 1) // block_size
    per_block = block_size * num_kv_heads
    for i in range(num_heads):
        for d in range(head_dim):
            qh[i, d] = q[row, i, d] * scale
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
                        x += qh[h * group + g, d] * k_row[d]
                    scores[h * group + g, j * block_size + o] = x
    for i in range(num_heads):
        top = scores[i, 0]
        for p in range(1, length):
            top = max(top, scores[i, p])
        total = np.float32(0.0)
        for p in range(length):
            e = exp_f32(scores[i, p] - top)
            scores[i, p] = e
            total += e
        inv = np.float32(1.0) / total
        for p in range(length):
            scores[i, p] *= inv
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
                        acc[h * group + g, d] += w * v_row[d]
    for i in range(num_heads):
        for d in range(head_dim):
            out[row, i, d] = acc[i, d]


@_jit()
def _attend_row(
    q, k_rows, v_rows, tables, table_of, lengths, rows, r, scale, out, scores, acc, qh,
    block_size, num_kv_heads,
):  # fmt: skip
    """Row ``r`` of the batch, prefetching the first KV blocks of row ``r + 1``."""
    n = lengths.shape[0]
    following = min(r + 1, n - 1)
    _attend_one(
        q, k_rows, v_rows, tables[table_of[r]], lengths[r], tables[table_of[following]],
        lengths[following] if r + 1 < n else 0, rows[r], scale, out, scores, acc, qh,
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
    if n:  # the first row's first blocks; every later row's come with the row before
        for j in range(min(PREFETCH_BLOCKS, (lengths[0] + block_size - 1) // block_size)):
            _prefetch_block(k_rows, tables[table_of[0], j], block_size * num_kv_heads, head_dim)
    for r in range(n):
        _attend_row(q, k_rows, v_rows, tables, table_of, lengths, rows, r, scale, out,
                    scores, acc, qh, block_size, num_kv_heads)  # fmt: skip


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
        _attend_row(q, k_rows, v_rows, tables, table_of, lengths, rows, r, scale, out,
                    scores, acc, qh, block_size, num_kv_heads)  # fmt: skip


def _usable(query, k_cache, v_cache) -> bool:
    return (
        numba is not None
        and query.device.type == "cpu"
        and query.dtype == k_cache.dtype == v_cache.dtype == torch.float32
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


_last_plan: list[_Plan | None] = [None]  # the plan of the batch the layers last attended


def _plan(num_tokens, block_size, block_tables, seq_lens, query_start_loc) -> _Plan:
    """The last plan when called again with the same metadata tensors, unchanged
    since (the next layer of the same forward), else a new one. The plan holds its
    tensors, so an identity check cannot match a new tensor at a freed address."""
    inputs = (block_tables, seq_lens, query_start_loc, num_tokens, block_size)
    if any(t.is_inference() for t in inputs[:3]):  # no version counter: never reused
        versions = None
    else:
        versions = (block_tables._version, seq_lens._version, query_start_loc._version)
    last = _last_plan[0]
    if (
        versions is not None
        and last is not None
        and all(x is y for x, y in zip(last.inputs, inputs[:3]))
        and last.inputs[3:] == inputs[3:]
        and last.versions == versions
    ):
        return last
    pieces = reference.split_pieces(num_tokens, block_size, block_tables, seq_lens,
                                    query_start_loc, SHORT_PIECE_WORK)  # fmt: skip
    plan = _Plan(
        inputs, versions, pieces, _row_arrays(block_tables, pieces) if pieces.together else None
    )
    _last_plan[0] = plan
    return plan


def _row_arrays(block_tables, pieces: reference.Pieces) -> tuple:
    """Every query row of ``pieces.together`` for the kernel: its sequence's table,
    its row in the batch and how many positions it sees (row ``i`` of a piece of
    ``q_len`` rows: the first ``seq_len - q_len + i + 1``)."""
    seqs, starts = pieces.together, pieces.starts
    tables = block_tables.index_select(0, torch.tensor(seqs, dtype=torch.int64))
    tables = tables.to(torch.int64).numpy()
    first = np.array([starts[s] for s in seqs], dtype=np.int64)
    q_lens = np.array([starts[s + 1] - starts[s] for s in seqs], dtype=np.int64)
    seq_lens = np.array([pieces.lens[s] for s in seqs], dtype=np.int64)
    if int(q_lens.max()) == 1:  # decode rows only, one per sequence
        return tables, np.arange(len(seqs), dtype=np.int64), seq_lens, first
    table_of = np.repeat(np.arange(len(seqs), dtype=np.int64), q_lens)
    # each row's index within its piece
    within = np.arange(len(table_of), dtype=np.int64) - np.repeat(
        np.cumsum(q_lens) - q_lens, q_lens
    )
    return tables, table_of, (seq_lens - q_lens)[table_of] + within + 1, first[table_of] + within


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
    on the compiled kernel where it applies (fp32 on the CPU, no soft-capping, no
    sliding window shorter than the longest sequence: those take the reference)."""
    cuts = window is not None and (max_seq_len is None or max_seq_len > window)
    if not _usable(query, k_cache, v_cache) or cuts or soft_cap is not None:
        return reference.paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                         query_start_loc, scale, window=window, soft_cap=soft_cap)  # fmt: skip
    checks.check_paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
    )
    plan = _plan(query.shape[0], k_cache.shape[1], block_tables, seq_lens, query_start_loc)
    out = reference.attend_long_pieces(query, k_cache, v_cache, block_tables, plan.pieces, scale)
    if plan.rows is not None:
        tables, table_of, lengths, rows = plan.rows
        threads = torch.get_num_threads()
        parallel = threads > 1 and len(rows) > 1
        if parallel:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        (_attend_all_parallel if parallel else _attend_all)(
            query.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(), tables, table_of,
            lengths, rows, np.float32(scale), out.numpy(),
        )  # fmt: skip
    return out
