"""Dead and hung ranks: recompute on fresh ranks, or a clear error — never a hang."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from iterserve.cluster.engine.api import EngineDeadError, EngineError
from iterserve.scheduler import FakeExecutor, SamplingParams
from tests.cluster.conftest import (
    PROMPTS,
    collect,
    collect_all,
    fake_config,
    model_config,
    rank_pids,
    start_engine,
    wait_idle,
)

pytestmark = pytest.mark.usefixtures("ray_session")
HANG_GUARD_S = 120  # a test that hangs fails here instead of blocking the suite


async def test_killed_rank_is_replaced_and_every_request_completes_unchanged(tiny_llama, reference):
    config = model_config(tiny_llama, tensor_parallel_size=2)
    engine = await start_engine(config)
    try:
        pids = await rank_pids(engine)
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        tasks = asyncio.ensure_future(collect_all(engine, PROMPTS, params))
        for _ in range(20_000):  # bounded; the kill lands mid-generation
            if (await engine.stats())["step"] >= 3:
                break
            await asyncio.sleep(0.005)
        os.kill(pids[1], signal.SIGKILL)
        results = await asyncio.wait_for(tasks, HANG_GUARD_S)
        assert [tokens for tokens, _ in results] == reference
        stats = await wait_idle(engine)
        assert stats["rank_restarts"] == 1 and stats["kv_blocks_used"] == 0
        assert set(await rank_pids(engine)).isdisjoint(pids)
        assert await engine.health() == (True, "ok")
    finally:
        await engine.shutdown()


async def test_rank_crashing_inside_a_step_is_recovered_by_recompute():
    config = fake_config(
        executor="faulty",
        executor_options={"output_len": 12, "max_model_len": 128, "fault_crash_at_step": 5},
    )
    engine = await start_engine(config)
    try:
        params = SamplingParams(max_tokens=20, temperature=0)
        ids = [f"crash-{i}" for i in range(6)]
        results = await asyncio.wait_for(
            asyncio.gather(*(collect(engine, [3, 4, 5], params, request_id=rid) for rid in ids)),
            HANG_GUARD_S,
        )
        reference = FakeExecutor(vocab_size=1000, output_len=12)
        assert results == [reference.expected_output(rid, params) for rid in ids]
        stats = await engine.stats()
        assert stats["rank_restarts"] == 1 and stats["num_recomputed_tokens"] > 0
    finally:
        await engine.shutdown()


async def test_hung_rank_is_caught_by_the_step_timeout():
    config = fake_config(
        step_timeout_s=3.0,
        executor="faulty",
        executor_options={"output_len": 8, "max_model_len": 128, "fault_hang_at_step": 3},
    )
    engine = await start_engine(config)
    try:
        params = SamplingParams(max_tokens=20, temperature=0)
        results = await asyncio.wait_for(
            asyncio.gather(
                *(collect(engine, [3], params, request_id=f"hang-{i}") for i in range(4))
            ),
            HANG_GUARD_S,
        )
        reference = FakeExecutor(vocab_size=1000, output_len=8)
        assert results == [reference.expected_output(f"hang-{i}", params) for i in range(4)]
        assert (await engine.stats())["rank_restarts"] == 1
    finally:
        await engine.shutdown()


async def test_an_engine_bug_fails_every_request_at_once_and_the_engine_reports_it():
    """A step result that contradicts the scheduler is a bug, not a rank failure:
    nothing can be recomputed on trust. Every request ends at once with an error,
    health says why, and new requests are refused rather than left to hang."""
    config = fake_config(
        executor="faulty",
        executor_options={
            "output_len": None,
            "max_model_len": 128,
            "step_sleep_s": 0.01,
            "fault_bad_result_at_step": 4,
        },
    )
    engine = await start_engine(config)
    try:
        params = SamplingParams(max_tokens=100)
        results = await asyncio.wait_for(
            asyncio.gather(
                *(collect(engine, [3], params) for _ in range(5)), return_exceptions=True
            ),
            HANG_GUARD_S,
        )
        assert all(isinstance(r, EngineError) for r in results), results
        assert all("ProtocolError" in str(r) for r in results)
        healthy, message = await engine.health()
        assert not healthy and "ProtocolError" in message
        with pytest.raises(EngineDeadError):
            await collect(engine, [3], params)
    finally:
        await engine.shutdown()


async def test_without_restarts_every_in_flight_request_ends_with_a_clear_error():
    config = fake_config(
        max_restarts=0,
        executor="faulty",
        executor_options={
            "output_len": None,
            "max_model_len": 128,
            "step_sleep_s": 0.01,
            "fault_crash_at_step": 4,
        },
    )
    engine = await start_engine(config)
    try:
        params = SamplingParams(max_tokens=100)
        results = await asyncio.wait_for(
            asyncio.gather(
                *(collect(engine, [3], params) for _ in range(5)), return_exceptions=True
            ),
            HANG_GUARD_S,
        )
        assert all(isinstance(r, EngineError) for r in results), results
        assert all("could not be restarted" in str(r) for r in results)
        healthy, message = await engine.health()
        assert not healthy and "could not be restarted" in message
        with pytest.raises(EngineDeadError):
            await collect(engine, [3], params)
        stats = await engine.stats()
        assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0
    finally:
        await engine.shutdown()
