"""An engine's tenants end to end (in this process, no Ray): the tenant a client
names travels in the request's record, the engine serves it under fair, and its
stats and metrics count it; a flooding tenant is refused by name."""

from __future__ import annotations

import asyncio

import pytest

from iterserve.cluster.engine.errors import EngineBusyError
from iterserve.cluster.openai.operations import aggregate_stats
from iterserve.scheduler import FakeModel
from tests.cluster.inproc import engine_in_process


async def _drain(stream) -> int:
    tokens = 0
    async for batch in stream:
        tokens += sum(len(out.token_ids) for out in batch)
    return tokens


async def test_tenants_are_served_counted_and_summed_over_replicas():
    model = FakeModel(vocab_size=64, max_model_len=64, output_len=4)
    async with engine_in_process(
        model, scheduling_policy="fair", tenants={"gold": {"weight": 2}}, max_num_seqs=2,
        num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
    ) as (core, client):  # fmt: skip
        streams = [
            await client.open(f"r{i}", [3 + i, 4, 5, 6, 7], {"max_tokens": 4, "tenant": tenant}, 0)
            for i, tenant in enumerate(["gold", "bronze", "gold", "bronze"])
        ]
        assert await asyncio.gather(*map(_drain, streams)) == [4] * 4
        for _ in range(100):
            if not core.scheduler.has_work:
                break
            await asyncio.sleep(0)
        stats = await core.stats()
    tenants = stats["tenants"]
    assert tenants["gold"]["served_tokens"] == tenants["bronze"]["served_tokens"] == 2 * (5 + 4)
    # fair's counter: tokens computed / weight (the last token of each is never computed)
    assert tenants["gold"]["served"] == pytest.approx(tenants["bronze"]["served"] / 2)
    summed = aggregate_stats([stats, stats], "m")["tenants"]
    assert summed["gold"]["served_tokens"] == 2 * tenants["gold"]["served_tokens"]
    assert summed["gold"]["served"] == tenants["gold"]["served"]


async def test_a_flooding_tenant_is_refused_before_anyone_else():
    model = FakeModel(vocab_size=64, max_model_len=64, output_len=4)
    async with engine_in_process(
        model, scheduling_policy="fair", max_queue_len=8, max_queue_len_per_tenant=2,
        max_num_seqs=1, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
    ) as (core, client):  # fmt: skip
        flood = {"tenant": "flood", "max_tokens": 40}
        opened = await asyncio.gather(
            *(client.open(f"f{i}", [3, 4], flood, 0) for i in range(8)), return_exceptions=True
        )
        refused = [r for r in opened if isinstance(r, Exception)]
        assert refused and all(isinstance(r, EngineBusyError) for r in refused)
        assert "tenant 'flood' has 2 requests waiting" in refused[0].message
        light = await client.open("l", [3, 4], {"tenant": "light", "max_tokens": 2}, 0)
        assert await _drain(light) == 2
        for stream in opened:
            if not isinstance(stream, Exception):
                stream.cancel()
