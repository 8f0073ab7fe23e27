"""The engine through Ray with the fake executor: the control plane on its own."""

from __future__ import annotations

import asyncio

import pytest

from iterserve.cluster.engine.api import (
    ContextLengthError,
    EngineBusyError,
    EngineError,
    InvalidRequestError,
)
from iterserve.scheduler import POLICIES, FakeExecutor, SamplingParams
from tests.cluster.conftest import assert_sound, collect, fake_config, start_engine, wait_idle

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.mark.parametrize("policy", POLICIES)
async def test_every_policy_streams_exactly_the_expected_tokens(policy):
    engine = await start_engine(fake_config(policy=policy))
    try:
        reference = FakeExecutor(vocab_size=1000, output_len=6)
        params = [SamplingParams(max_tokens=m, temperature=0) for m in (3, 6, 9, 12)]
        prompts = [[5 + i] * (1 + 3 * i) for i in range(4)]
        ids = [f"{policy}-{i}" for i in range(4)]
        results = await asyncio.gather(
            *(collect(engine, p, sp, request_id=rid) for p, sp, rid in zip(prompts, params, ids))
        )
        for rid, sp, (tokens, reason) in zip(ids, params, results):
            assert (tokens, reason) == reference.expected_output(rid, sp)
        stats = await engine.stats()
        assert stats["policy"] == policy and stats["kv_blocks_used"] == 0
        await assert_sound(engine)
    finally:
        await engine.shutdown()


async def test_leaving_a_stream_early_aborts_and_frees_slot_and_blocks():
    engine = await start_engine(
        fake_config(
            executor_options={"output_len": None, "max_model_len": 128, "step_sleep_s": 0.005}
        )
    )
    try:
        params = SamplingParams(max_tokens=100, temperature=0)
        seen = 0
        async for out in engine.generate([1, 2, 3], params):
            seen += len(out.token_ids)
            if seen >= 3:
                break
        stats = await wait_idle(engine)
        assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0
        assert stats["counters"]["finished_abort"] == 1
        await assert_sound(engine)
    finally:
        await engine.shutdown()


async def test_queue_bound_is_respected():
    engine = await start_engine(
        fake_config(
            max_queue_len=2,
            max_num_seqs=1,
            executor_options={"output_len": None, "max_model_len": 128, "step_sleep_s": 0.1},
        )
    )
    try:
        params = SamplingParams(max_tokens=120)  # ~12 s each: they outlast the checks below
        # One runs, two wait: the queue is at its bound. Started one at a time, since a
        # request that arrives before the first is admitted would itself find the queue full.
        tasks = []
        for num_waiting in (0, 1, 2):
            tasks.append(asyncio.ensure_future(collect(engine, [1], params)))
            for _ in range(1500):  # bounded: a slow machine fails the assert, never hangs
                stats = await engine.stats()
                if stats["num_running"] == 1 and stats["num_waiting"] == num_waiting:
                    break
                await asyncio.sleep(0.02)
        assert (await engine.stats())["num_waiting"] == 2
        with pytest.raises(EngineBusyError, match="queue is full"):
            await collect(engine, [1], params)
        for task in tasks:  # cancelling a stream aborts its request
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stats = await wait_idle(engine)
        assert stats["counters"]["rejected_queue_full"] == 1
        assert stats["num_waiting"] == 0 and stats["slots_used"] == 0
    finally:
        await engine.shutdown()


async def test_bad_requests_are_refused_with_a_message_and_reach_no_slot():
    engine = await start_engine(fake_config())
    try:
        with pytest.raises(ContextLengthError, match="128 tokens"):
            await collect(engine, [1] * 200, SamplingParams())
        with pytest.raises(InvalidRequestError, match=r"prompt token ids must be in \[0, 999\]"):
            await collect(engine, [5000], SamplingParams())
        with pytest.raises(InvalidRequestError, match="logprobs"):
            await collect(engine, [1], SamplingParams(logprobs=50))
        with pytest.raises(InvalidRequestError, match="empty"):
            await collect(engine, [], SamplingParams())
        stats = await engine.stats()
        assert stats["step"] == 0 and stats["num_waiting"] == 0
    finally:
        await engine.shutdown()


async def test_health_exercises_the_ranks():
    engine = await start_engine(fake_config())
    try:
        assert await engine.health() == (True, "ok")
    finally:
        await engine.shutdown()


async def test_health_and_integrity_checks_while_steps_are_planned_ahead():
    """A check waits for the step in flight, never behind a whole busy period, and
    the streams it interrupts go on with exactly their tokens."""
    engine = await start_engine(
        fake_config(
            executor_options={"output_len": None, "max_model_len": 128, "step_sleep_s": 0.005}
        )
    )
    try:
        params = SamplingParams(max_tokens=60, temperature=0)
        ids = [f"busy-{i}" for i in range(4)]
        streams = asyncio.gather(*(collect(engine, [3, 4, 5], params, request_id=r) for r in ids))
        for _ in range(5):
            await asyncio.sleep(0.03)
            assert await engine.health() == (True, "ok")
        reference = FakeExecutor(vocab_size=1000)
        for rid, result in zip(ids, await streams):
            assert result == reference.expected_output(rid, params)
        stats = await wait_idle(engine)
        assert stats["timing"]["steps_ahead"] > 0
        assert stats["kv_blocks_used"] == 0 and stats["slots_used"] == 0
    finally:
        await engine.shutdown()


async def test_a_bad_result_a_health_check_collects_ends_the_engine_with_its_own_error():
    """Health checks drain the step built ahead; when that step's result breaks the
    scheduler, the engine stops as the loop would have, naming the ProtocolError,
    and never steps again on the scheduler's broken count of steps in flight."""
    engine = await start_engine(
        fake_config(
            executor="faulty",
            executor_options={"output_len": None, "step_sleep_s": 0.3,
                              "fault_bad_result_at_step": 5},
        )
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=100, temperature=0)
        streams = asyncio.gather(
            *(collect(engine, [3, 4, 5], params) for _ in range(3)), return_exceptions=True
        )
        for _ in range(2000):  # until step 5 is built ahead, while step 4 runs
            if (await engine.stats())["step"] >= 5:
                break
            await asyncio.sleep(0.01)
        # Queued behind the loop's wait for step 4, the check then collects step 5.
        health = await engine.health()
        assert not health[0] and "ProtocolError" in health[1], health
        for result in await asyncio.wait_for(streams, 60):
            assert isinstance(result, EngineError) and "ProtocolError" in str(result)
        assert (await engine.health())[1] == health[1]  # the first reason stays
    finally:
        await engine.shutdown()


async def test_engine_error_type_is_exported():
    assert issubclass(EngineError, RuntimeError)


async def test_metrics_record_every_request_and_step():
    engine = await start_engine(fake_config())
    try:
        params = SamplingParams(max_tokens=4, temperature=0)
        await asyncio.gather(*(collect(engine, [1, 2], params) for _ in range(3)))
        text = (await engine.actor.metrics_text.remote()).decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)

        def sample(prefix, label=""):
            return sum(v for k, v in samples.items() if k.startswith(prefix) and label in k)

        assert sample("iterserve_time_to_first_token_seconds_count") == 3
        assert sample("iterserve_generation_tokens_total") == 12
        assert sample("iterserve_prompt_tokens_total") == 6
        assert sample("iterserve_requests_finished_total", 'reason="length"') == 3
        assert sample("iterserve_inter_token_latency_seconds_count") == 9
        assert sample("iterserve_step_duration_seconds_count") >= 4
        assert sample("iterserve_slots_used") == 0
    finally:
        await engine.shutdown()


async def test_metrics_are_visible_on_rays_own_metrics_path_when_asked():
    import urllib.request

    import ray

    port = ray._private.worker._global_node.metrics_export_port
    engine = await start_engine(fake_config(ray_metrics=True))
    try:
        await collect(engine, [1, 2], SamplingParams(max_tokens=3, temperature=0))
        found = []
        for _ in range(60):  # Ray's agent exports every few seconds
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                body = r.read().decode()
            found = [
                line
                for line in body.splitlines()
                if line.startswith("ray_iterserve_generation_tokens_total")
            ]
            if found:
                break
            await asyncio.sleep(0.5)
        assert found and all('model_name="' in line and 'engine="' in line for line in found)
    finally:
        await engine.shutdown()
