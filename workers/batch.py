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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from iterserve.scheduler.messages import ScheduledSeq, StepPlan
from iterserve.scheduler.seq_table import PlanMismatchError, SequenceTable
from iterserve.workers.model import AttentionInputs


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [num_rows] int64
    positions: torch.Tensor  # [num_rows] int64
    attn: AttentionInputs
    logits_indices: torch.Tensor  # [num_logits] int64
    sample_entries: list[ScheduledSeq]  # own the first len(sample_entries) logits rows
    num_rows: int


def build_batch(
    plan: StepPlan,
    table: SequenceTable,
    *,
    block_size: int,
    scratch_block: int,
    pad_token_id: int,
    max_position: int,
    device: torch.device,
) -> FlatBatch:
    """The flat batch for ``plan``; ``table`` must already have applied it."""
    ids: list[int] = []
    starts = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    sample_rows: list[int] = []
    sample_entries: list[ScheduledSeq] = []
    first_pos: list[int] = []  # per sequence: position of its first row

    for entry in plan.scheduled:
        seq = table.get(entry.slot_idx)
        end = entry.start_pos + entry.num_tokens
        if any(not 0 <= b < scratch_block for b in entry.new_block_ids):
            raise PlanMismatchError(
                f"slot {entry.slot_idx} ({seq.request_id}): block ids {entry.new_block_ids} "
                f"outside the cache's {scratch_block} blocks"
            )
        if entry.num_tokens <= 0:
            raise PlanMismatchError(f"slot {entry.slot_idx}: num_tokens must be positive")
        if end > max_position:
            raise PlanMismatchError(
                f"slot {entry.slot_idx} ({seq.request_id}): position {end - 1} is beyond the "
                f"model's {max_position} positions"
            )
        needed = -(-end // block_size)
        if needed > len(seq.block_ids):
            raise PlanMismatchError(
                f"slot {entry.slot_idx} ({seq.request_id}): {end} tokens need {needed} blocks, "
                f"the worker has {len(seq.block_ids)}"
            )
        if entry.sample and end != len(seq.token_ids):
            raise PlanMismatchError(
                f"slot {entry.slot_idx} ({seq.request_id}): sampling after position {end - 1}, "
                f"but the sequence has {len(seq.token_ids)} tokens"
            )
        ids.extend(table.input_ids(entry))
        first_pos.append(entry.start_pos)
        starts.append(len(ids))
        seq_lens.append(end)
        tables.append(seq.block_ids[:needed])
        if entry.sample:
            sample_rows.append(len(ids) - 1)
            sample_entries.append(entry)

    num_pads = sum(e.num_pad_tokens for e in plan.scheduled)
    pad_logit_rows = []
    padded_len = max(seq_lens, default=1)  # the rectangle a static batch computes
    for i in range(num_pads + len(plan.padding_slots)):
        ids.append(pad_token_id)
        first_pos.append(0)
        starts.append(len(ids))
        seq_lens.append(padded_len)
        tables.append([scratch_block])
        if i >= num_pads:
            # A finished-but-batched member still decodes; its logits are the honest cost.
            pad_logit_rows.append(len(ids) - 1)

    q_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    seq_of_row = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    row_starts = torch.tensor(starts[:-1], dtype=torch.long)
    positions = torch.tensor(first_pos, dtype=torch.long)[seq_of_row] + (
        torch.arange(len(ids)) - row_starts[seq_of_row]
    )
    width = max((len(t) for t in tables), default=1)
    block_tables = torch.full((len(tables), width), scratch_block, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    # Padding rows sit at position 0 of the scratch block, so this also sends them there.
    block_ids = block_tables[seq_of_row, positions // block_size].long()
    slot_mapping = block_ids * block_size + positions % block_size

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return FlatBatch(
        input_ids=dev(torch.tensor(ids, dtype=torch.long)),
        positions=dev(positions),
        attn=AttentionInputs(
            slot_mapping=dev(slot_mapping),
            block_tables=dev(block_tables),
            seq_lens=dev(torch.tensor(seq_lens, dtype=torch.int32)),
            query_start_loc=dev(torch.tensor(starts, dtype=torch.int32)),
        ),
        logits_indices=dev(torch.tensor(sample_rows + pad_logit_rows, dtype=torch.long)),
        sample_entries=sample_entries,
        num_rows=len(ids),
    )
