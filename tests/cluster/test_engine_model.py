"""The engine through Ray on a tiny real checkpoint: same tokens as one process."""

from __future__ import annotations

import asyncio

import pytest

from iterserve.scheduler import POLICIES, SamplingParams
from tests.cluster.conftest import (
    GREEDY,
    PROMPTS,
    assert_sound,
    collect_all,
    model_config,
    rank_pids,
    single_process,
    start_engine,
    wait_idle,
)

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.mark.parametrize("policy", POLICIES)
async def test_every_policy_matches_the_single_process_runner(tiny_llama, reference, policy):
    engine = await start_engine(model_config(tiny_llama, policy=policy))
    try:
        results = await collect_all(engine, PROMPTS, GREEDY)
        assert [tokens for tokens, _ in results] == reference
        assert all(reason == "length" for _, reason in results)
        stats = await wait_idle(engine)
        assert stats["kv_blocks_used"] == 0 and stats["slots_used"] == 0
        await assert_sound(engine)
    finally:
        await engine.shutdown()


async def test_tensor_parallel_two_ranks_match_one(tiny_llama, reference):
    config = model_config(tiny_llama, tensor_parallel_size=2)
    engine = await start_engine(config)
    try:
        results = await collect_all(engine, PROMPTS, GREEDY)
        assert [tokens for tokens, _ in results] == reference
        assert len(set(await rank_pids(engine))) == 2
        assert (await engine.stats())["rank_links"] == ["unix", "unix"]  # on this node
    finally:
        await engine.shutdown()


async def test_abort_mid_stream_frees_slot_and_blocks(tiny_llama):
    engine = await start_engine(model_config(tiny_llama))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        received = 0
        async for out in engine.generate(PROMPTS[3], params):
            received += len(out.token_ids)
            if received >= 2:
                break
        other = asyncio.ensure_future(collect_all(engine, PROMPTS[:2], GREEDY))
        stats = await wait_idle(engine)
        await other
        assert stats["kv_blocks_used"] == 0 and stats["counters"]["finished_abort"] == 1
        await assert_sound(engine)
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_a_sequence_ending_on_a_stop_token_while_the_next_step_is_planned(
    tiny_llama, reference, async_scheduling
):
    """The step after a stop token was planned before the scheduler knew of it: the
    rank computes that sequence's row as padding, and every output is still the
    single-process runner's."""
    stop = reference[1][2]  # the third token of the second prompt's output
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=(stop,))
    expected = single_process(tiny_llama, PROMPTS, params, policy="continuous")
    assert any(len(tokens) < 10 for tokens in expected)
    config = model_config(tiny_llama, policy="continuous", async_scheduling=async_scheduling)
    engine = await start_engine(config)
    try:
        results = await collect_all(engine, PROMPTS, params)
        assert [tokens for tokens, _ in results] == expected
        for tokens, reason in results:
            assert reason == ("stop_token" if tokens[-1] == stop else "length")
        stats = await wait_idle(engine)
        assert stats["kv_blocks_used"] == 0 and stats["slots_used"] == 0
        assert (stats["timing"]["steps_ahead"] > 0) == async_scheduling
        # Continuous batching pads nothing, except those rows of planned-ahead steps.
        assert (stats["counters"]["padding_tokens"] > 0) == async_scheduling
        await assert_sound(engine)
    finally:
        await engine.shutdown()


async def speculate_on_two_ranks(tiny_llama, prompts, max_tokens: int, spec: dict) -> dict:
    """``prompts`` through an engine of two tensor-parallel ranks with ``spec``, its
    tokens checked against decoding without proposals in one process; its stats."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    want = single_process(tiny_llama, prompts, params)
    engine = await start_engine(
        model_config(tiny_llama, tensor_parallel_size=2, speculative_config=spec)
    )
    try:
        results = await collect_all(engine, prompts, params)
        assert [tokens for tokens, _ in results] == want
        stats = await wait_idle(engine)
        assert stats["kv_blocks_used"] == 0
        await assert_sound(engine)
        return stats
    finally:
        await engine.shutdown()


async def test_speculation_on_two_ranks_gives_the_same_tokens(tiny_llama):
    """Prompt-lookup proposals verified by two tensor-parallel ranks, with the
    engine's scheduling ahead on: the tokens of decoding without them."""
    prompts = [[4, 5, 6, 7] * 5, [9, 8, 7] * 6 + [9], PROMPTS[3], PROMPTS[1]]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}  # fmt: skip
    stats = await speculate_on_two_ranks(tiny_llama, prompts, 40, spec)
    assert stats["spec_decode_num_accepted_tokens"] > 0


async def test_a_draft_model_on_two_ranks_gives_the_same_tokens(tiny_llama):
    """Each rank runs the whole draft beside its half of the target: the tokens of
    decoding without proposals (the draft is the target itself: every one kept)."""
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    stats = await speculate_on_two_ranks(tiny_llama, [PROMPTS[0], PROMPTS[3], PROMPTS[1]], 30, spec)
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
