"""A stopping engine drains: every client hears it at once, new requests are
refused as ``draining``, the requests it has run to their last token, and those
still running at ``drain_timeout_s`` end with an error that says so. An engine
whose ranks are gone for good tells its clients ``dead``. The restart budget
counts restarts in a window, not over the engine's life. (In process, no Ray.)"""

from __future__ import annotations

import asyncio

import pytest

from iterserve.cluster.engine.core import RestartBudget
from iterserve.cluster.engine.errors import EngineDeadError, EngineDrainingError
from iterserve.scheduler import FakeExecutor, FakeModel, SamplingParams
from tests.cluster.inproc import engine_in_process

CONFIG = dict(num_kv_blocks=512, max_num_seqs=8, block_size=4, max_num_batched_tokens=256)


async def _read(stream) -> tuple[list[int], str | None, str | None]:
    tokens: list[int] = []
    reason = error = None
    async for batch in stream:
        for out in batch:
            tokens.extend(out.token_ids)
            reason, error = out.finish_reason or reason, out.error or error
    return tokens, reason, error


async def test_a_draining_engine_finishes_its_streams_token_for_token_and_takes_nothing_new():
    model = FakeModel(vocab_size=300, step_sleep_s=0.002)
    params = SamplingParams(max_tokens=40)
    async with engine_in_process(model, **CONFIG) as (core, client):
        streams = [
            await client.open(f"r{i}", [1, 5, 7 + i], {"max_tokens": 40}, 0) for i in range(12)
        ]
        readers = [asyncio.create_task(_read(s)) for s in streams]
        await asyncio.sleep(0.02)  # mid-stream
        drain = asyncio.create_task(core.drain(timeout_s=60))
        with pytest.raises(EngineDrainingError):
            await client.open("late", [1, 2, 3], {"max_tokens": 4}, 0)
        assert client.state == "draining" and not client.usable  # heard before the refusal
        drained = await drain
        results = await asyncio.gather(*readers)
    assert drained["cut"] == 0 and drained["finished"] > 0  # some were running at the start
    fake = FakeExecutor(vocab_size=300)
    for i, (tokens, reason, error) in enumerate(results):
        assert (reason, error) == ("length", None)
        assert tokens == fake.expected_output(f"r{i}", params)[0]


async def test_requests_still_running_at_the_drain_deadline_end_with_a_clear_error():
    model = FakeModel(vocab_size=300, step_sleep_s=0.005)
    async with engine_in_process(model, **CONFIG) as (core, client):
        streams = [await client.open(f"r{i}", [1, 2, 3], {"max_tokens": 100000}, 0) for i in (0, 1)]
        readers = [asyncio.create_task(_read(s)) for s in streams]
        await asyncio.sleep(0.05)
        drained = await core.drain(timeout_s=0.1)
        results = await asyncio.gather(*readers)
        assert core.scheduler.stats()["kv_blocks_used"] == 0  # nothing leaked
    assert drained == {"finished": 0, "cut": 2}
    for tokens, reason, error in results:
        assert tokens, "the stream ran before the deadline"
        assert reason == "error" and "drain_timeout_s" in error


async def test_a_dead_engine_tells_its_clients_and_refuses_as_dead():
    async with engine_in_process(FakeModel(vocab_size=300), **CONFIG) as (core, client):
        core._fail_all("the engine's ranks failed and could not be restarted")
        with pytest.raises(EngineDeadError):
            await client.open("x", [1, 2], {"max_tokens": 2}, 0)
        assert client.state == "dead" and not client.usable
        assert "could not be restarted" in client.state_message


def test_the_restart_budget_counts_restarts_within_its_window_only():
    now = [0.0]
    budget = RestartBudget(max_restarts=2, window_s=100.0, clock=lambda: now[0])
    assert budget.take() and budget.take()
    assert not budget.take()  # a third within the window: the engine ends
    for _ in range(5):  # the same failures, spread over a long life, never add up
        now[0] += 100.0
        assert budget.take()
    assert budget.take() is True and budget.take() is False
