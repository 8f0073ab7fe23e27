"""The engine through Ray on a tiny real checkpoint: same tokens as one process."""

from __future__ import annotations

import asyncio

import pytest

from iterserve.scheduler import POLICIES, SamplingParams
from tests.cluster.conftest import (
    GREEDY,
    PROMPTS,
    collect_all,
    model_config,
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
        await engine.actor.check_integrity.remote()
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("transport", ["auto", "compiled_graph", "actor_calls"])
async def test_tensor_parallel_two_ranks_match_one(tiny_llama, reference, transport):
    config = model_config(tiny_llama, tensor_parallel_size=2, step_transport=transport)
    engine = await start_engine(config)
    try:
        results = await collect_all(engine, PROMPTS, GREEDY)
        assert [tokens for tokens, _ in results] == reference
        assert len(set(await engine.actor.worker_pids.remote())) == 2
        expected = "socket" if transport == "auto" else transport
        assert (await engine.stats())["step_transport"] == expected
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
        await engine.actor.check_integrity.remote()
    finally:
        await engine.shutdown()
