"""Backpressure, timeouts and disconnects on a deliberately slow engine.

One slot, a waiting queue of two, 50 ms steps, no EOS, and a 3 s request
timeout: long requests pile up on purpose.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from iterserve.scheduler import FakeExecutor, SamplingParams
from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import (
    MODEL,
    assert_engines_sound,
    deploy,
    fake_engine,
    sse_events,
    undeploy,
    wait_idle,
)

APP = "slow"
TIMEOUT_S = 10.0  # generous: the 429 test fills the queue first, on a busy machine


@pytest.fixture(scope="module")
def slow_url(serve_url, tokenizer_dir, vocab_size):
    config = fake_engine(
        vocab_size,
        max_num_seqs=1,
        max_queue_len=2,
        # A long context: requests can ask for more tokens than the timeout lets them make.
        executor_options={"output_len": None, "step_sleep_s": 0.05, "max_model_len": 1024},
    )
    yield deploy(
        serve_url, APP, model=str(tokenizer_dir), config=config, request_timeout_s=TIMEOUT_S
    )
    undeploy(APP)


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return Tokenizer(tokenizer_dir)


def long_request(**extra) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 1000, **extra}


async def test_a_full_queue_is_429_with_retry_after(slow_url):
    async with httpx.AsyncClient(base_url=slow_url, timeout=30) as client:

        async def hold():  # stream until the engine times the request out
            async with client.stream(
                "POST", "/v1/completions", json=long_request(stream=True)
            ) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    pass

        holders = []
        try:
            # One running, two waiting: the queue is at its bound. One at a time: a request
            # arriving before the first is admitted would itself find the queue full.
            for num_waiting in (0, 1, 2):
                holders.append(asyncio.create_task(hold()))
                for _ in range(400):
                    stats = (await client.get("/v1/stats")).json()
                    if stats["num_running"] == 1 and stats["num_waiting"] == num_waiting:
                        break
                    await asyncio.sleep(0.05)
            assert stats["num_running"] == 1 and stats["num_waiting"] == 2, json.dumps(stats)
            r = await client.post("/v1/completions", json=long_request())
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) >= 1
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and "queue is full" in error["message"]
        finally:
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
        await wait_idle(client)


async def test_a_request_past_its_timeout_is_aborted_with_504(slow_url):
    async with httpx.AsyncClient(base_url=slow_url, timeout=30) as client:
        before = (await client.get("/v1/stats")).json()["replicas"][0]["counters"]
        r = await client.post("/v1/completions", json=long_request())
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "timeout"
        assert f"request_timeout_s={TIMEOUT_S:g}" in r.json()["error"]["message"]
        stats = await wait_idle(client)
        assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0
        after = stats["replicas"][0]["counters"]
        assert after.get("finished_abort", 0) == before.get("finished_abort", 0) + 1


async def test_a_stream_past_its_timeout_ends_with_an_error_event(slow_url):
    async with httpx.AsyncClient(base_url=slow_url, timeout=30) as client:
        body = long_request(stream=True)
        async with client.stream("POST", "/v1/completions", json=body) as r:
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[0]["choices"][0]["text"] is not None  # tokens came before the timeout
        assert events[-1]["error"]["code"] == "timeout"
        await wait_idle(client)


async def test_a_stop_string_ends_the_engine_request_at_once(slow_url, tok, vocab_size):
    fake = FakeExecutor(vocab_size=vocab_size, output_len=None)
    tokens, _ = fake.expected_output("bp-stop-0", SamplingParams(max_tokens=1000))
    text = tok.decode(tokens[:8])
    usable = [i for i in range(1, len(text) - 2) if "\ufffd" not in text[i : i + 2]]
    start = next(i for i in usable if text.find(text[i : i + 2]) == i)
    body = long_request(stop=text[start : start + 2])
    async with httpx.AsyncClient(base_url=slow_url, timeout=30) as client:
        before = (await client.get("/v1/stats")).json()["replicas"][0]["counters"]
        r = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "bp-stop"})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (text[:start], "stop")
        stats = await wait_idle(client, timeout_s=TIMEOUT_S - 1)  # long before 1000 tokens
        assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0
        after = stats["replicas"][0]["counters"]
        assert after.get("finished_abort", 0) == before.get("finished_abort", 0) + 1


async def test_a_client_that_leaves_frees_its_slot_and_blocks(slow_url):
    async with httpx.AsyncClient(base_url=slow_url, timeout=30) as client:
        before = (await client.get("/v1/stats")).json()["replicas"][0]["counters"]
        body = long_request(stream=True)
        async with client.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream
        stats = await wait_idle(client, timeout_s=TIMEOUT_S - 1)  # before the timeout would
        assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0
        after = stats["replicas"][0]["counters"]
        assert after.get("finished_abort", 0) == before.get("finished_abort", 0) + 1
        await assert_engines_sound(APP)


async def test_a_client_that_gives_up_on_a_whole_response_frees_its_slot(slow_url):
    async with httpx.AsyncClient(base_url=slow_url, timeout=30) as client:
        before = (await client.get("/v1/stats")).json()["replicas"][0]["counters"]
        with pytest.raises(httpx.ReadTimeout):  # the client hangs up after 0.5 s
            await client.post("/v1/completions", json=long_request(), timeout=0.5)
        stats = await wait_idle(client, timeout_s=TIMEOUT_S - 1)  # before the timeout would
        assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0
        after = stats["replicas"][0]["counters"]
        assert after.get("finished_abort", 0) == before.get("finished_abort", 0) + 1
