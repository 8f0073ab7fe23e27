"""256 concurrent streams over two engine replicas, half of them abandoned at random
points (seeded), five rounds. After every round no replica holds a slot, a KV
block or a waiting request, each replica's allocators pass the check it runs when idle,
and every stream that was read to its end carried all of its tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import httpx
import pytest

from tests.reliability.conftest import idle_replicas
from tests.serve.conftest import MODEL, assert_engines_sound, deploy, fake_engine, undeploy

APP = "storm"
NUM_STREAMS = 256
NUM_ROUNDS = 5
MAX_TOKENS = 16  # streams read to the end
LONG = 200  # abandoned streams ask for more, so they can only end by abort


@pytest.fixture(scope="module")
def storm_url(serve_url, tokenizer_dir, vocab_size):
    config = fake_engine(
        vocab_size,
        max_num_seqs=64,
        max_queue_len=512,
        num_kv_blocks=4096,
        max_num_batched_tokens=512,
        executor_options={"output_len": None, "max_model_len": 256, "step_sleep_s": 0.002},
    )
    yield deploy(serve_url, APP, model=str(tokenizer_dir), config=config, num_engine_replicas=2)
    undeploy(APP)


async def one_stream(
    client: httpx.AsyncClient,
    i: int,
    max_tokens: int,
    leave_after: int | None = None,
    progress: dict | None = None,
) -> str:
    """Streams one completion; leaves after ``leave_after`` events (0: right after
    the headers; None: reads to the end). Returns how it ended."""
    body = {"model": MODEL, "prompt": f"storm {i}", "max_tokens": max_tokens, "stream": True}
    body["stream_options"] = {"include_usage": True}
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        if progress is not None:
            progress["admitted"] = True  # the status line comes after the engine accepted
        if leave_after == 0:
            return "left"
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                assert events[-1]["usage"]["completion_tokens"] == max_tokens, events[-1]
                return "done"
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
                assert "error" not in events[-1], events[-1]
                if leave_after is not None and len(events) >= leave_after:
                    return "left"  # closing the response drops the connection
    return "cut"


async def cancelled_after(delay_s: float, client, i: int) -> str:
    """Starts a long stream and cancels it after ``delay_s``: before its response
    headers ("cancelled-early") or while it streams ("cancelled-mid")."""
    progress: dict = {}
    task = asyncio.ensure_future(one_stream(client, i, LONG, progress=progress))
    done, _ = await asyncio.wait([task], timeout=delay_s)
    if done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return "cancelled-mid" if progress else "cancelled-early"


async def one_round(client: httpx.AsyncClient, rng: random.Random, round_no: int) -> Counter:
    jobs = []
    for i in range(NUM_STREAMS):
        stream_id = round_no * NUM_STREAMS + i
        if rng.random() < 0.5:
            jobs.append(one_stream(client, stream_id, MAX_TOKENS))
        elif rng.random() < 0.75:
            jobs.append(one_stream(client, stream_id, LONG, leave_after=rng.randint(0, 8)))
        else:
            jobs.append(cancelled_after(rng.uniform(0.0, 4.0), client, stream_id))
    return Counter(await asyncio.wait_for(asyncio.gather(*jobs), 300))


async def test_abandoned_streams_leave_nothing_behind_round_after_round(storm_url):
    rng = random.Random(20261129)
    limits = httpx.Limits(max_connections=NUM_STREAMS + 16, max_keepalive_connections=32)
    totals: Counter = Counter()
    async with httpx.AsyncClient(base_url=storm_url, timeout=120, limits=limits) as client:
        for round_no in range(NUM_ROUNDS):
            outcomes = await one_round(client, rng, round_no)
            totals.update(outcomes)
            assert outcomes["cut"] == 0, outcomes
            replicas = await idle_replicas(client, timeout_s=60)
            assert len(replicas) == 2
            for replica in replicas:
                held = {k: replica[k] for k in ("slots_used", "kv_blocks_used")}
                queued = {k: replica[k] for k in ("num_running", "num_waiting")}
                assert held == {"slots_used": 0, "kv_blocks_used": 0}, (round_no, replica)
                assert queued == {"num_running": 0, "num_waiting": 0}, (round_no, replica)
            await assert_engines_sound(APP)
            print(f"\nround {round_no}: {dict(outcomes)}")
    finished = sum(r["counters"].get("finished_length", 0) for r in replicas)
    aborted = sum(r["counters"].get("finished_abort", 0) for r in replicas)
    print(f"totals: {dict(totals)}; engine: {finished} finished by length, {aborted} aborted")
    # Every request the engines admitted ended exactly once, by length or by abort. A
    # stream left late may have had all its tokens already (a batch of several steps
    # travels as one event); one cancelled before admission never reached an engine.
    assert finished >= totals["done"] >= NUM_ROUNDS * NUM_STREAMS // 3
    admitted = finished + aborted
    assert totals["done"] + totals["left"] + totals["cancelled-mid"] <= admitted
    assert admitted <= NUM_ROUNDS * NUM_STREAMS
    assert all(r["counters"].get("prompt_tokens", 0) > 0 for r in replicas), "a replica idled"
