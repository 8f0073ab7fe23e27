"""Seeded sampling, drawn by hypothesis: the same seed gives the same tokens
whatever shares the batch, whenever the sequence is preempted (released, then
sent again with the tokens it produced) and whenever the rank restarts (a fresh
sampler). The logits of a row depend only on its own tokens, as a model's do, so
any difference is the sampler's."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.scheduler.sampling import SamplingParams
from iterserve.workers.sampler import Sampler

VOCAB = 24
NUM_TOKENS = 8


@dataclass
class Row:
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int
    counts_row: int = -1
    counted: tuple[int, int] = (0, -1)


def logits_of(row: Row) -> torch.Tensor:
    """A model's logits for the row's next token: a function of its tokens alone."""
    seed = zlib.crc32(bytes(t % 256 for t in row.token_ids))
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def new_sampler() -> Sampler:
    return Sampler(frozenset({0}), "cpu", seed=5)


params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.7, 1.0, 1.5]),
    top_k=st.sampled_from([0, 5]),
    top_p=st.sampled_from([1.0, 0.9]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    frequency_penalty=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**63 - 1),
    ignore_eos=st.just(True),
)
# Per step: "sample" (with the drawn neighbours), "preempt" (sent again later with
# what it produced), "restart" (every sequence comes back to a fresh sampler).
events = st.lists(st.sampled_from(["sample", "sample", "preempt", "restart"]), max_size=30)


def alone(p: SamplingParams, prompt: list[int]) -> list[int]:
    sampler, row = new_sampler(), Row(p, list(prompt), len(prompt), 0)
    for _ in range(NUM_TOKENS):
        row.token_ids.append(sampler(logits_of(row)[None], [row]).token_ids[0])
    return row.token_ids[len(prompt) :]


@settings(max_examples=80, deadline=None)
@given(
    seeded=st.lists(
        st.tuples(params, st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=4)),
        min_size=1,
        max_size=3,
    ),  # fmt: skip
    neighbours=st.integers(0, 3),
    schedule=events,
    order=st.randoms(use_true_random=False),
)
def test_a_seeded_sequence_draws_the_same_tokens_through_batches_preemptions_and_restarts(
    seeded, neighbours, schedule, order
):
    sampler = new_sampler()
    rows = [Row(p, list(prompt), len(prompt), i) for i, (p, prompt) in enumerate(seeded)]
    others = [Row(SamplingParams(temperature=1.0), [1, 2], 2, 100 + i) for i in range(neighbours)]
    events_left = list(schedule)
    while any(len(r.token_ids) - r.num_prompt_tokens < NUM_TOKENS for r in rows):
        event = events_left.pop(0) if events_left else "sample"
        if event == "restart":  # a fresh rank: every sequence is sent again
            sampler = new_sampler()
            rows = [Row(r.params, list(r.token_ids), r.num_prompt_tokens, r.seq_id) for r in rows]
            continue
        live = [r for r in rows if len(r.token_ids) - r.num_prompt_tokens < NUM_TOKENS]
        if event == "preempt":  # one sequence leaves the rank and comes back with its tokens
            gone = order.choice(live)
            sampler.release(gone)
            rows[rows.index(gone)] = Row(gone.params, list(gone.token_ids), gone.num_prompt_tokens, gone.seq_id)  # fmt: skip
            continue
        batch = live + others
        order.shuffle(batch)
        out = sampler(torch.stack([logits_of(r) for r in batch]), batch)
        for r, token in zip(batch, out.token_ids):
            r.token_ids.append(token)
    for (p, prompt), row in zip(seeded, rows):
        assert row.token_ids[len(prompt) :] == alone(p, prompt)
