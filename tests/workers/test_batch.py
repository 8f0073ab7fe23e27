"""The flat batch layout: vectorised arrays equal a per-sequence construction."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from iterserve.scheduler.messages import NewSequence, ScheduledSeq, StepPlan
from iterserve.scheduler.sampling import SamplingParams
from iterserve.scheduler.seq_table import PlanMismatchError, SequenceTable
from iterserve.workers import batch
from iterserve.workers.batch import Staging, build_batch, layout_batch

BS, SCRATCH, PAD = 4, 99, 0


def per_sequence(plan: StepPlan, table: SequenceTable):
    """The layout written the slow, obvious way: one sequence at a time."""
    ids, starts, seq_lens, tables, positions, slots, sample_rows = [], [0], [], [], [], [], []
    for e in plan.scheduled:
        seq = table.get(e.slot_idx)
        end = e.start_pos + e.num_tokens
        blocks = seq.block_ids[: -(-end // BS)]
        for p in range(e.start_pos, end):
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(blocks[p // BS] * BS + p % BS)
        starts.append(len(ids))
        seq_lens.append(end)
        tables.append(blocks)
        if e.sample:
            sample_rows.append(len(ids) - 1)
    num_pads = sum(e.num_pad_tokens for e in plan.scheduled)
    longest = max(seq_lens, default=1)
    for i in range(num_pads + len(plan.padding_slots)):
        ids.append(PAD)
        positions.append(0)
        slots.append(SCRATCH * BS)
        starts.append(len(ids))
        seq_lens.append(longest)
        tables.append([])
        if i >= num_pads:
            sample_rows.append(len(ids) - 1)
    width = max(max(len(t) for t in tables), 1)
    bt = [t + [SCRATCH] * (width - len(t)) for t in tables]
    return ids, positions, slots, sample_rows, seq_lens, starts, bt


def random_step(rng: random.Random, decode: bool = False):
    table = SequenceTable()
    params = SamplingParams(temperature=0.0)
    scheduled, new, next_block = [], [], 0
    for slot in range(rng.randint(1, 12)):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(1, 60))]
        new.append(NewSequence(slot, f"r{slot}", slot, prompt, len(prompt), params))
        start = len(prompt) - 1 if decode else rng.randrange(len(prompt))
        n = rng.randint(1, len(prompt) - start)
        blocks = list(range(next_block, next_block + -(-(start + n) // BS) + rng.randint(0, 2)))
        next_block += len(blocks)
        sample = start + n == len(prompt)
        pads = 0 if decode else rng.choice([0, 0, 1, 3])
        scheduled.append(ScheduledSeq(slot, start, n, blocks, sample=sample, num_pad_tokens=pads))
    plan = StepPlan(0, new_seqs=new, padding_slots=rng.sample(range(50, 60), rng.randint(0, 2)))
    table.apply(plan)
    for e in scheduled:
        table.get(e.slot_idx).num_computed_tokens = e.start_pos
        table.get(e.slot_idx).block_ids.extend(e.new_block_ids)
    return StepPlan(1, scheduled=scheduled, padding_slots=plan.padding_slots), table


@pytest.mark.parametrize("few_rows", [0, 10**6], ids=["torch", "lists"])
@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("seed", range(12))
def test_layout_matches_a_per_sequence_construction(seed, decode, few_rows, monkeypatch):
    # Both ways of working out positions and slots: torch ops, or lists for few rows.
    monkeypatch.setattr(batch, "FEW_ROWS", few_rows)
    plan, table = random_step(random.Random(seed), decode)
    host = layout_batch(
        plan, table, block_size=BS, scratch_block=SCRATCH, pad_token_id=PAD, max_position=1000
    )
    want = per_sequence(plan, table)
    for got, expected in zip(host.arrays(), want, strict=True):
        assert got.dtype == torch.int32
        assert got.tolist() == expected
    assert host.max_query_len == max(e.num_tokens for e in plan.scheduled)
    assert host.max_seq_len == max(e.start_pos + e.num_tokens for e in plan.scheduled)
    assert [e.slot_idx for e in host.sample_entries] == [
        e.slot_idx for e in plan.scheduled if e.sample
    ]


def test_staging_puts_every_array_in_one_buffer():
    plan, table = random_step(random.Random(3))
    kw = dict(block_size=BS, scratch_block=SCRATCH, pad_token_id=PAD, max_position=1000)
    staging = Staging(torch.device("cpu"))
    staged = build_batch(plan, table, device=torch.device("cpu"), staging=staging, **kw)
    plain = build_batch(plan, table, device=torch.device("cpu"), **kw)
    for a, b in [
        (staged.input_ids, plain.input_ids.int()),
        (staged.positions, plain.positions.int()),
        (staged.logits_indices, plain.logits_indices.int()),
        (staged.attn.slot_mapping, plain.attn.slot_mapping.int()),
        (staged.attn.block_tables, plain.attn.block_tables),
        (staged.attn.seq_lens, plain.attn.seq_lens),
        (staged.attn.query_start_loc, plain.attn.query_start_loc),
    ]:
        assert torch.equal(a, b)
        # one buffer, each view 256 bytes aligned within it
        base = staged.input_ids.untyped_storage().data_ptr()
        assert a.untyped_storage().data_ptr() == base
        assert (a.data_ptr() - base) % 256 == 0


def test_layout_rejects_what_the_table_cannot_compute():
    plan, table = random_step(random.Random(5))
    entry = plan.scheduled[0]
    table.get(entry.slot_idx).block_ids.clear()
    with pytest.raises(PlanMismatchError, match="blocks"):
        layout_batch(plan, table, block_size=BS, scratch_block=SCRATCH, pad_token_id=PAD,
                     max_position=1000)  # fmt: skip


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(new_block_ids=[SCRATCH]), "outside the cache's 99 blocks"),
        (dict(new_block_ids=[-1]), "outside the cache's 99 blocks"),
        (dict(num_tokens=0), "num_tokens must be positive"),
        (dict(start_pos=2000), "beyond the model's 1000 positions"),
    ],
)
def test_layout_names_the_slot_and_the_problem_of_a_bad_entry(change, message):
    plan, table = random_step(random.Random(6), decode=True)
    bad = dataclasses.replace(plan.scheduled[0], **change)
    plan = dataclasses.replace(plan, scheduled=[bad, *plan.scheduled[1:]])
    with pytest.raises(PlanMismatchError, match=message):
        layout_batch(plan, table, block_size=BS, scratch_block=SCRATCH, pad_token_id=PAD,
                     max_position=1000)  # fmt: skip
