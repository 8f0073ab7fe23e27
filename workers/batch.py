"""Lays one :class:`StepPlan` out as a single flat batch of token rows.

Real rows come first, entry by entry in plan order; padding rows follow, one
per padding token. Each padding row is a sequence of its own: one query row
whose K/V is written to the scratch block, attending over the step's longest
KV length with every block-table entry pointing at the scratch block. It costs
what a padded row of a rectangular batch costs, attention included, and cannot
disturb any real sequence::

    plan: A decode @17, B prefill piece [0, 3) sample, C decode @40 with 1 pad,
          padding_slots [7]
    rows:            A17 | B0 B1 B2 | C40 | padC | pad7
    query_start_loc: 0     1          4     5      6     7
    seq_lens:        18    3          41    41     41
    logits rows:     A17, B2, C40, pad7 (the last one is computed and discarded)

An entry with proposals (speculative decoding) has a logits row for each of
its rows: the token after each is sampled.

The layout is built on the host as a few CPU tensors, one per field, from
flat Python lists: nothing is made per sequence. On CUDA they are packed into
one pinned buffer and cross to the device in a single copy (:class:`Staging`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kernels import AttentionMetadata
from ..scheduler.blocks import blocks_for
from ..scheduler.messages import ScheduledSeq, StepPlan
from ..scheduler.seq_table import PlanMismatchError, SequenceTable

# Token ids, positions, slots and block ids all fit int32 (the cache checks its
# slot count), which every kernel and torch index op accepts.
INDEX_DTYPE = torch.int32
# Segments of a staging buffer start on 256-byte boundaries, so every device
# view is as aligned as a fresh allocation (kernels specialise on alignment).
_ALIGN = 64


@dataclass
class HostBatch:
    """One step's flat batch on the host: int32 CPU tensors."""

    input_ids: torch.Tensor  # [num_rows]
    positions: torch.Tensor  # [num_rows]
    slot_mapping: torch.Tensor  # [num_rows] block_id * block_size + offset
    logits_indices: torch.Tensor  # [num_logits] sampled rows first, then padding slots
    seq_lens: torch.Tensor  # [num_seqs] KV length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    block_tables: torch.Tensor  # [num_seqs, width]
    # Own the first logits rows: one each, or 1 + k for an entry with k proposals.
    sample_entries: list[ScheduledSeq]
    max_query_len: int
    max_seq_len: int

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def arrays(self) -> tuple[torch.Tensor, ...]:
        return (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.logits_indices,
            self.seq_lens,
            self.query_start_loc,
            self.block_tables,
        )


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [num_rows]
    attn: AttentionMetadata  # positions, slots, tables, lengths: handed to every layer
    logits_indices: torch.Tensor  # [num_logits]
    sample_entries: list[ScheduledSeq]  # own the first len(sample_entries) logits rows
    num_rows: int

    @property
    def positions(self) -> torch.Tensor:  # [num_rows]
        return self.attn.positions


def layout_batch(
    plan: StepPlan,
    table: SequenceTable,
    *,
    block_size: int,
    scratch_block: int,
    pad_token_id: int,
    max_position: int,
) -> HostBatch:
    """The flat batch for ``plan`` on the host; ``table`` must already have applied it."""
    ids: list[int] = []
    q_lens: list[int] = []
    first_pos: list[int] = []  # per sequence: position of its first row
    seq_lens: list[int] = []
    tables: list[list[int]] = []  # per sequence: its block ids (the first `needed` are used)
    needed_blocks: list[int] = []
    freed_blocks: list[int] = []  # per sequence: its leading blocks out of every window
    sample_rows: list[int] = []
    sample_entries: list[ScheduledSeq] = []

    for entry in plan.scheduled:
        seq = table.get(entry.slot_idx)
        end = entry.start_pos + entry.num_tokens
        needed = blocks_for(end, block_size)
        _check_entry(entry, seq, end, needed, scratch_block, max_position)
        ids.extend(seq.token_ids[entry.start_pos : end])
        q_lens.append(entry.num_tokens)
        first_pos.append(entry.start_pos)
        seq_lens.append(end)
        tables.append(seq.block_ids)
        needed_blocks.append(needed)
        freed_blocks.append(seq.num_freed_blocks)
        if entry.sample:
            if entry.num_draft_tokens:  # a draft samples after each of its rows
                sample_rows.extend(range(len(ids) - entry.num_tokens, len(ids)))
            else:
                sample_rows.append(len(ids) - 1)
            sample_entries.append(entry)

    num_real_rows = len(ids)
    num_pads = sum(e.num_pad_tokens for e in plan.scheduled)
    num_padding = num_pads + len(plan.padding_slots)
    padded_len = max(seq_lens, default=1)  # the rectangle a static batch computes
    # A finished-but-batched member (padding slot) still decodes; its logits are the
    # honest cost. Prefill padding rows get none.
    pad_logit_rows = list(range(num_real_rows + num_pads, num_real_rows + num_padding))
    ids.extend([pad_token_id] * num_padding)
    q_lens.extend([1] * num_padding)
    first_pos.extend([0] * num_padding)
    seq_lens.extend([padded_len] * num_padding)
    tables.extend([[]] * num_padding)
    needed_blocks.extend([0] * num_padding)  # the table row stays all scratch
    freed_blocks.extend([0] * num_padding)

    block_tables = _block_tables(tables, needed_blocks, freed_blocks, scratch_block)
    positions, slot_mapping, starts = _positions_and_slots(
        q_lens, first_pos, tables, needed_blocks, block_tables, block_size, scratch_block
    )
    return HostBatch(
        input_ids=torch.tensor(ids, dtype=INDEX_DTYPE),
        positions=positions.to(INDEX_DTYPE),
        slot_mapping=slot_mapping.to(INDEX_DTYPE),
        logits_indices=torch.tensor(sample_rows + pad_logit_rows, dtype=INDEX_DTYPE),
        seq_lens=torch.tensor(seq_lens, dtype=INDEX_DTYPE),
        query_start_loc=starts.to(INDEX_DTYPE),
        block_tables=block_tables,
        sample_entries=sample_entries,
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )


def _check_entry(
    entry: ScheduledSeq, seq, end: int, needed: int, scratch_block: int, max_position: int
) -> None:
    """A plan entry this worker cannot run as written is a plan mismatch, never a
    wrong answer."""
    new_blocks = entry.new_block_ids
    if new_blocks and not (0 <= min(new_blocks) and max(new_blocks) < scratch_block):
        raise PlanMismatchError(
            f"{_name(entry, seq)}: block ids {new_blocks} outside the cache's "
            f"{scratch_block} blocks"
        )
    if entry.num_tokens <= 0:
        raise PlanMismatchError(f"slot {entry.slot_idx}: num_tokens must be positive")
    if end > max_position:
        raise PlanMismatchError(
            f"{_name(entry, seq)}: position {end - 1} is beyond the model's "
            f"{max_position} positions"
        )
    if needed > len(seq.block_ids):
        raise PlanMismatchError(
            f"{_name(entry, seq)}: {end} tokens need {needed} blocks, "
            f"the worker has {len(seq.block_ids)}"
        )
    if entry.sample and end != len(seq.token_ids):
        raise PlanMismatchError(
            f"{_name(entry, seq)}: sampling after position {end - 1}, "
            f"but the sequence has {len(seq.token_ids)} tokens"
        )


def _name(entry: ScheduledSeq, seq) -> str:
    return f"slot {entry.slot_idx} ({seq.label})"


def _block_tables(tables: list[list[int]], needed_blocks: list[int], freed_blocks: list[int],
                  scratch_block: int):  # fmt: skip
    """One row per sequence: its first ``needed`` block ids, then the scratch block;
    the blocks handed on (out of every window, never read) are scratch too, so no
    row names a block another sequence may own now."""
    width = max(max(needed_blocks, default=1), 1)
    # One tensor from one flat list: after a forward, each torch op the host runs
    # costs several times its warm price, and this was eight of them.
    flat: list[int] = []
    for blocks, n, freed in zip(tables, needed_blocks, freed_blocks):
        flat += [scratch_block] * freed
        flat += blocks[freed:n]
        flat += [scratch_block] * (width - n)
    return torch.tensor(flat, dtype=INDEX_DTYPE).reshape(len(tables), width)


# Up to this many rows, positions and slots are worked out in Python lists (three
# tensors made at the end); past it, in a dozen torch ops, each costing ~10-20 µs
# after a forward has left the caches cold but little more for more rows. A step of
# four sequences verifying four proposals each (20 rows) spent ~0.15 ms in them.
FEW_ROWS = 128


def _positions_and_slots(
    q_lens, first_pos, tables, needed_blocks, block_tables, block_size, scratch_block
):
    """Each row's position and KV slot, and where each sequence's rows start."""
    num_seqs, num_rows = len(q_lens), sum(q_lens)
    if num_rows == num_seqs:  # decode rows only (padding included): one row per sequence
        # Made in the index dtype: the caller's conversions are then no-ops.
        starts = torch.arange(num_seqs + 1, dtype=INDEX_DTYPE)
        positions = torch.tensor(first_pos, dtype=INDEX_DTYPE)
        slots = [
            (t[p // block_size] if n else scratch_block) * block_size + p % block_size
            for t, n, p in zip(tables, needed_blocks, first_pos, strict=True)
        ]
        return positions, torch.tensor(slots, dtype=INDEX_DTYPE), starts
    if num_rows <= FEW_ROWS:  # a few rows a sequence: lists, as for decode rows
        row_positions: list[int] = []
        row_slots: list[int] = []
        row_starts = [0]
        # The rows of block_tables, as the torch path below reads them.
        for t, p, q in zip(block_tables.tolist(), first_pos, q_lens, strict=True):
            for pos in range(p, p + q):
                row_positions.append(pos)
                row_slots.append(t[pos // block_size] * block_size + pos % block_size)
            row_starts.append(row_starts[-1] + q)
        return (torch.tensor(row_positions, dtype=INDEX_DTYPE),
                torch.tensor(row_slots, dtype=INDEX_DTYPE),
                torch.tensor(row_starts, dtype=INDEX_DTYPE))  # fmt: skip
    q_lens_t = torch.tensor(q_lens)
    starts = torch.zeros(num_seqs + 1, dtype=torch.int64)
    torch.cumsum(q_lens_t, 0, out=starts[1:])
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), q_lens_t)
    # row r of sequence s sits at first_pos[s] + (r - starts[s])
    positions = torch.arange(num_rows) + torch.repeat_interleave(
        torch.tensor(first_pos) - starts[:-1], q_lens_t
    )
    # Padding rows sit at position 0 of the scratch block, so this also sends them there.
    block_ids = block_tables[seq_of_row, positions // block_size].long()
    return positions, block_ids * block_size + positions % block_size, starts


def flat_batch(host: HostBatch, tensors: Sequence[torch.Tensor]) -> FlatBatch:
    """The device view of ``host``, given its arrays as tensors (same order as ``arrays()``)."""
    input_ids, positions, slots, logits_indices, seq_lens, starts, tables = tensors
    return FlatBatch(
        input_ids=input_ids,
        attn=AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=seq_lens,
            query_start_loc=starts,
            max_query_len=host.max_query_len,
            max_seq_len=host.max_seq_len,
        ),
        logits_indices=logits_indices,
        sample_entries=host.sample_entries,
        num_rows=host.num_rows,
    )


def to_device(host: HostBatch, device: torch.device, staging: Staging | None = None) -> FlatBatch:
    """``host`` on ``device``: through ``staging`` (one copy) when given, otherwise
    one tensor per field. Without staging the per-row fields become int64, the
    dtype the torch references index with, so no layer converts them again."""
    if staging is not None:
        return flat_batch(host, staging.put(host.arrays()))
    arrays = host.arrays()
    rows = [a.to(device, torch.int64) for a in arrays[:4]]
    return flat_batch(host, rows + [a.to(device) for a in arrays[4:]])


def build_batch(
    plan: StepPlan,
    table: SequenceTable,
    *,
    block_size: int,
    scratch_block: int,
    pad_token_id: int,
    max_position: int,
    device: torch.device,
    staging: Staging | None = None,
) -> FlatBatch:
    """The flat batch for ``plan``; ``table`` must already have applied it."""
    host = layout_batch(
        plan,
        table,
        block_size=block_size,
        scratch_block=scratch_block,
        pad_token_id=pad_token_id,
        max_position=max_position,
    )
    return to_device(host, torch.device(device), staging)


def segment_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Start of each segment in a staging buffer, and the buffer's used length."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // _ALIGN) * _ALIGN
    return offsets, end


class Staging:
    """A pinned host buffer and its device twin, grown on demand: a step's host
    tensors are written side by side into the host buffer and cross to the device
    in one asynchronous copy. Before the host buffer is written again, the copy
    that read it last must be done; an event records that."""

    def __init__(self, device: torch.device, dtype: torch.dtype = INDEX_DTYPE, capacity: int = 0):
        self.device = torch.device(device)
        self.dtype = dtype
        self._pinned = self.device.type == "cuda"
        self._host = torch.empty(0, dtype=dtype)
        self._dev = torch.empty(0, dtype=dtype, device=self.device)
        self._copied = torch.cuda.Event() if self._pinned else None
        self._reserve(capacity)

    def _reserve(self, n: int) -> None:
        if n <= self._host.numel():
            return
        n = max(n, 2 * self._host.numel())
        if self._copied is not None:
            self._copied.synchronize()  # the old buffer may still be read
        self._host = torch.empty(n, dtype=self.dtype, pin_memory=self._pinned)
        self._dev = torch.empty(n, dtype=self.dtype, device=self.device)

    def put(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies host ``tensors`` to the device; returns one device view per tensor."""
        offsets, end = segment_offsets([t.numel() for t in tensors])
        self._reserve(end)
        if self._copied is not None:
            self._copied.synchronize()
        for t, off in zip(tensors, offsets):
            self._host[off : off + t.numel()].copy_(t.reshape(-1))
        self._dev[:end].copy_(self._host[:end], non_blocking=self._pinned)
        if self._copied is not None:
            self._copied.record()
        return [self._dev[off : off + t.numel()].view(t.shape) for t, off in zip(tensors, offsets)]
