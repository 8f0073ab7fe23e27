"""Two engine replicas behind one ingress, 64 concurrent streams, half abandoned.

Afterwards no replica may hold a slot or a KV block, both replicas must have
served traffic, and every stream read to the end must carry exactly the
tokens the fake engine produces for its request id.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from iterserve.scheduler import FakeExecutor, SamplingParams
from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import (
    MODEL,
    assert_engines_sound,
    deploy,
    engine_replicas,
    fake_engine,
    stream_completion,
    undeploy,
    wait_idle,
)

APP = "dp"
NUM_STREAMS = 64
MAX_TOKENS = 24
# What an abandoned stream asks for: far more than its abort takes to reach the engine
# (~25-40 tokens of 5-ms steps on average here, 100 at the tail of a loaded run).
ABANDONED_MAX_TOKENS = 400


@pytest.fixture(scope="module")
def dp_url(serve_url, tokenizer_dir, vocab_size):
    config = fake_engine(
        vocab_size,
        max_num_seqs=8,
        num_kv_blocks=1024,  # every slot can hold an abandoned stream's whole length
        executor_options={"output_len": None, "step_sleep_s": 0.005, "max_model_len": 512},
    )
    yield deploy(serve_url, APP, model=str(tokenizer_dir), config=config, num_engine_replicas=2)
    undeploy(APP)


async def one_stream(client: httpx.AsyncClient, i: int, leave_after: int | None):
    """Streams request ``dp<i>``; leaves after ``leave_after`` events (None: to the end)."""
    # Abandoned streams ask for far more tokens: they must end by abort, not by length.
    max_tokens = MAX_TOKENS if leave_after is None else ABANDONED_MAX_TOKENS
    body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": max_tokens, "stream": True}
    body["stream_options"] = {"include_usage": True}
    # Leaving closes the response, which drops the connection.
    leave = None if leave_after is None else (lambda events: len(events) >= leave_after)
    return await stream_completion(client, body, headers={"X-Request-Id": f"dp{i}"}, on_event=leave)


async def test_abandoned_streams_leak_nothing_and_both_replicas_serve(
    dp_url, tokenizer_dir, vocab_size
):
    rng = random.Random(7)
    plan = {i: (rng.randint(1, 4) if i % 2 else None) for i in range(NUM_STREAMS)}
    limits = httpx.Limits(max_connections=NUM_STREAMS + 8)
    async with httpx.AsyncClient(base_url=dp_url, timeout=120, limits=limits) as client:
        results = await asyncio.gather(*(one_stream(client, i, n) for i, n in plan.items()))
        stats = await wait_idle(client)

    # Nothing left behind, on either replica.
    assert stats["num_engine_replicas"] == 2
    for replica in stats["replicas"]:
        assert replica["slots_used"] == 0 and replica["kv_blocks_used"] == 0, replica
        assert replica["num_running"] == 0 and replica["num_waiting"] == 0
        assert replica["counters"].get("prompt_tokens", 0) > 0, "a replica got no traffic"
    await assert_engines_sound(APP)

    # Every finished stream has exactly its request's tokens.
    tok = Tokenizer(tokenizer_dir)
    fake = FakeExecutor(vocab_size=vocab_size, output_len=None)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    finished = 0
    for i, (events, done) in enumerate(results):
        if plan[i] is not None:
            continue
        assert done
        tokens, _ = fake.expected_output(f"dp{i}-0", params)
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert text == tok.decode(tokens)
        assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        finished += 1
    assert finished == NUM_STREAMS // 2
    aborted = sum(r["counters"].get("finished_abort", 0) for r in stats["replicas"])
    lengths = sum(r["counters"].get("finished_length", 0) for r in stats["replicas"])
    assert lengths == NUM_STREAMS // 2
    assert aborted == NUM_STREAMS // 2


async def test_non_streaming_requests_spread_over_both_replicas(dp_url):
    async with httpx.AsyncClient(base_url=dp_url, timeout=120) as client:
        replicas = (await client.get("/v1/stats")).json()["replicas"]
        before = {r["replica"]: r["counters"].get("finished_length", 0) for r in replicas}
        body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "n": 2}
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(16))
        )
        assert all(r.status_code == 200 for r in responses)
        assert all(len(r.json()["choices"]) == 2 for r in responses)
        stats = await wait_idle(client)
    served = {
        r["replica"]: r["counters"].get("finished_length", 0) - before[r["replica"]]
        for r in stats["replicas"]
    }
    assert sum(served.values()) == 32
    assert all(count > 0 for count in served.values()), served


async def test_each_replica_drives_its_ranks_from_its_own_placement_group(dp_url):
    # Serve reserves one placement group per replica (scheduler bundle + rank bundles):
    # the ranks take their bundles, so the scheduler shares their node and reaches
    # them over Unix sockets.
    placements = await engine_replicas(APP, "placement")
    assert len({p["placement_group"] for p in placements}) == 2
    for p in placements:
        assert p["placement_group"] is not None
        assert [w["placement_group"] for w in p["workers"]] == [p["placement_group"]]
        assert [w["NodeID"] for w in p["workers"]] == [p["NodeID"]]
    stats = await engine_replicas(APP, "stats")
    assert [s["rank_links"] for s in stats] == [["unix"], ["unix"]]
