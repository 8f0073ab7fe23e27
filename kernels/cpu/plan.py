"""A step's attention arrays for the CPU kernels, built once a step on the rank.

Every layer of a step attends the same rows over the same block tables; the
metadata tensors (:class:`~iterserve.kernels.metadata.AttentionMetadata`) are
read once, checked once, and turned into the arrays the compiled kernels take:
which rows the row kernels attend and which prefill pieces are long
(:data:`SHORT_PIECE_WORK`), each row's table, length and first position under
each window the model has, the long pieces' arrays for the AMX kernel, and the
positions and slots the rotary op and the KV store read. :func:`prepare` builds
it (``KernelOps.prepare``); an op called without one builds its own.

In a batch-invariant engine (``invariant``) every piece, however long, goes to the
row kernels: a prompt's row then attends exactly as the same token does when it
is decoded, or recomputed after a preemption in a piece cut elsewhere (the row
kernels compute each row on its own, in the order of its own positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import checks, reference

# A prefill piece of at most this many query rows x positions x query heads runs
# on the row kernels too, whose time grows with all three; longer ones on the
# long-piece kernels (torch's flash attention, ~80 µs a piece and then little per
# position, or AMX). Measured in bf16, 4 pieces at once, 16/4 heads of 64: a
# 16-token prompt (4096) 0.25 ms on the row kernel against 0.36; 32 tokens (16384)
# 0.73 against 0.46; 64 tokens 2.3 against 0.8; 64 after 200 cached 16.0 against
# 3.6; 128 tokens 12.7 against 1.9. fp32, 16 pieces, 4/2 heads: 32 tokens (4096)
# 0.92 against 1.03; 64 tokens 2.8 against 1.8.
SHORT_PIECE_WORK = 8192
# The work under which a batch-invariant engine's pieces all fall: every one.
EVERY_PIECE = 1 << 62


@dataclass
class BatchPlan:
    """One step's attention arrays (int64): see the module docstring."""

    num_tokens: int
    num_heads: int
    block_size: int
    block_tables: torch.Tensor  # the step's, read by the long-piece kernels
    pieces: reference.Pieces
    # (tables, table_of, lengths, rows) of the rows the row kernels attend; None: none
    rows: tuple | None
    positions: np.ndarray | None  # [num_tokens]
    slots: np.ndarray | None  # [num_tokens]
    # each row's first position in reach, by window (a window that cuts no row: None)
    starts: dict[int, np.ndarray | None] = field(default_factory=dict)
    # the long pieces' (tables, first rows, query lengths, sequence lengths)
    long: tuple | None = None
    invariant: bool = False  # every piece on the rows, one row driver whatever their count

    def row_starts(self, window: int | None) -> np.ndarray | None:
        """Each row's first position under ``window``, None where it cuts no row."""
        if window is None or self.rows is None:
            return None
        if window not in self.starts:
            lengths = self.rows[2]
            cut = lengths.size and int(lengths.max()) > window
            self.starts[window] = np.maximum(lengths - window, 0) if cut else None
        return self.starts[window]

    def matches(self, num_tokens: int, num_heads: int, block_size: int,
                invariant: bool = False) -> bool:  # fmt: skip
        return (num_tokens, num_heads, block_size, invariant) == (
            self.num_tokens, self.num_heads, self.block_size, self.invariant
        )  # fmt: skip


def prepare(meta, *, num_heads: int, block_size: int, windows=(), invariant: bool = False
            ) -> BatchPlan:  # fmt: skip
    """The plan of ``meta`` (an ``AttentionMetadata``) for layers of ``num_heads``
    query heads over caches of ``block_size`` slots, with the rows' starts under
    each of ``windows`` made now. The metadata are checked here, once a step.
    ``invariant``: every piece on the row kernels (the module's docstring)."""
    plan = build(meta.positions.shape[0], num_heads, block_size, meta.block_tables,
                 meta.seq_lens, meta.query_start_loc, meta.positions, meta.slot_mapping,
                 invariant=invariant)  # fmt: skip
    for window in windows:
        plan.row_starts(window)
    return plan


def build(num_tokens, num_heads, block_size, block_tables, seq_lens, query_start_loc,
          positions=None, slot_mapping=None, *, invariant: bool = False) -> BatchPlan:  # fmt: skip
    """:func:`prepare` from the metadata tensors themselves."""
    checks.check_batch(block_tables, seq_lens, query_start_loc, torch.device("cpu"))
    short_work = EVERY_PIECE if invariant else SHORT_PIECE_WORK // num_heads
    pieces = reference.split_pieces(num_tokens, block_size, block_tables, seq_lens,
                                    query_start_loc, short_work)  # fmt: skip
    rows = _row_arrays(block_tables, pieces) if pieces.together else None
    long = _piece_arrays(block_tables, pieces, pieces.long) if pieces.long else None
    return BatchPlan(
        num_tokens, num_heads, block_size, block_tables, pieces, rows,
        _host_array(positions), _host_array(slot_mapping), long=long, invariant=invariant,
    )  # fmt: skip


def _host_array(tensor: torch.Tensor | None) -> np.ndarray | None:
    if tensor is None or not tensor.is_cpu:
        return None
    return tensor.to(torch.int64).numpy()


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
    """Every query row of ``pieces.together`` for the row kernels: its sequence's
    table, its row in the batch and how many positions it sees (row ``i`` of a
    piece of ``q_len`` rows: the first ``seq_len - q_len + i + 1``)."""
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
