"""Our forward pass against transformers' (eager attention, fp32)."""

from __future__ import annotations

import pytest
import torch
from plan_driver import GREEDY
from tiny_checkpoints import short_context

from iterserve.scheduler.messages import NewSequence, ScheduledSeq, StepPlan
from iterserve.workers import ModelRunner
from iterserve.workers.batch import build_batch

ATOL = 1e-4


def forward_all_rows(runner: ModelRunner, pieces: list[list[tuple[int, int]]], prompts):
    """Runs each prompt in the given (start, n) pieces; returns every row's logits."""
    bs = runner.block_size
    next_block = 0
    rows = [[] for _ in prompts]
    new = [NewSequence(i, f"r{i}", i, p, len(p), GREEDY) for i, p in enumerate(prompts)]
    given = [0] * len(prompts)
    for step in range(max(len(p) for p in pieces)):
        scheduled = []
        for i, seq_pieces in enumerate(pieces):
            if step >= len(seq_pieces):
                continue
            start, n = seq_pieces[step]
            need = -(-(start + n) // bs) - given[i]
            blocks = list(range(next_block, next_block + need))
            next_block += need
            given[i] += need
            scheduled.append(ScheduledSeq(i, start, n, blocks))
        plan = StepPlan(step=step, new_seqs=new if step == 0 else [], scheduled=scheduled)
        runner.table.apply(plan)
        batch = build_batch(
            plan,
            runner.table,
            block_size=bs,
            scratch_block=runner.kv_cache.scratch_block,
            pad_token_id=0,
            max_position=runner.model.cos_sin.shape[0],
            device=runner.device,
        )
        everything = torch.arange(batch.num_rows)
        logits = runner.model(batch.input_ids, batch.attn, everything)
        offset = 0
        for entry in plan.scheduled:
            rows[entry.slot_idx].append(logits[offset : offset + entry.num_tokens])
            offset += entry.num_tokens
            runner.table.advance(entry)
    return [torch.cat(r) for r in rows]


def split(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(chunk, length - s)) for s in range(0, length, chunk)]


@pytest.mark.parametrize("chunk", [1 << 20, 7])
def test_logits_match_transformers(arch, chunk, checkpoint_dir, hf_reference):
    runner = ModelRunner(
        checkpoint_dir(arch), num_kv_blocks=64, block_size=8, kernel_backend="torch",
        **short_context(arch),
    )  # fmt: skip
    hf = hf_reference(arch)
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 5, 16, 40, 100]
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    ours = forward_all_rows(runner, [split(n, chunk) for n in lengths], prompts)
    for prompt, got in zip(prompts, ours, strict=True):
        want = hf.logits(prompt)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
