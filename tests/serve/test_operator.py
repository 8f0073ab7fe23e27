"""The operator's routes over HTTP on the real server, through every engine replica:
``/pause`` (abort, wait, keep), ``/resume``, ``/is_paused``, ``/sleep``, ``/wake_up``,
``/is_sleeping``. A pause with ``keep`` emits no token while paused and loses none."""

from __future__ import annotations

import asyncio
import json

import httpx
import psutil
import pytest

from tests.serve.conftest import (
    API_KEY,
    AUTH,
    MODEL,
    deploy,
    engine_replicas,
    fake_engine,
    rank_pids,
    undeploy,
)

APP = "operator"
STEP_S = 0.02  # the fake model's step: slow enough to pause a stream in its middle


@pytest.fixture(scope="module")
def url(serve_url, tokenizer_dir, vocab_size):
    config = fake_engine(vocab_size, executor_options={"output_len": None, "step_sleep_s": STEP_S})
    yield deploy(serve_url, APP, model=str(tokenizer_dir), config=config, api_key=API_KEY,
                 num_engine_replicas=2)  # fmt: skip
    undeploy(APP)


class Stream:
    """A streamed completion read in the background: its token deltas as they come."""

    def __init__(self, url: str, max_tokens: int, request_id: str = "op-stream"):
        self.url, self.max_tokens, self.request_id = url, max_tokens, request_id
        self.deltas: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": self.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        headers = {**AUTH, "X-Request-Id": self.request_id}
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        self.usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        self.deltas.append(choice["text"])
                        self.finish_reason = choice["finish_reason"] or self.finish_reason

    async def until(self, num_deltas: int) -> None:
        while len(self.deltas) < num_deltas and not self.task.done():
            await asyncio.sleep(0.01)
        assert len(self.deltas) >= num_deltas, self.deltas


async def post(url: str, path: str, **params) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300) as client:
        return await client.post(path, params=params)


async def get(url: str, path: str) -> dict:
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:
        return (await client.get(path)).json()


async def test_the_routes_need_the_api_key_and_name_a_bad_value(url):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for path in ("/pause", "/resume", "/sleep", "/wake_up"):
            assert (await client.post(path)).status_code == 401
        assert (await client.get("/is_paused")).status_code == 401
    answer = await post(url, "/pause", mode="later")
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "mode"
    answer = await post(url, "/sleep", level="3")
    assert answer.status_code == 400 and "level" in answer.json()["error"]["message"]
    assert await get(url, "/is_paused") == {"is_paused": False, "num_engine_replicas": 2}


async def test_keep_emits_no_token_while_paused_and_loses_none(url):
    stream = Stream(url, max_tokens=80)
    await stream.until(5)
    answer = await post(url, "/pause", mode="keep")
    assert answer.json() == {"status": "paused", "mode": "keep", "aborted": 0,
                             "num_engine_replicas": 2}  # fmt: skip
    assert (await get(url, "/is_paused"))["is_paused"] is True
    await asyncio.sleep(5 * STEP_S)  # what was sent before the pause answered arrives
    seen = len(stream.deltas)
    await asyncio.sleep(40 * STEP_S)  # forty steps' time: not one token
    assert len(stream.deltas) == seen and not stream.task.done()
    # A request arriving while paused waits in the queue.
    late = Stream(url, max_tokens=4, request_id="op-late")
    await asyncio.sleep(10 * STEP_S)
    assert late.deltas == []
    assert (await post(url, "/resume")).json() == {"status": "resumed", "num_engine_replicas": 2}
    await asyncio.wait_for(asyncio.gather(stream.task, late.task), 120)
    assert stream.finish_reason == "length" and stream.usage["completion_tokens"] == 80
    assert late.usage["completion_tokens"] == 4
    # Every token came, and the same ones as without a pause (the fake model's tokens
    # are a function of the request's name and position).
    again = Stream(url, max_tokens=80)
    await again.task
    assert "".join(stream.deltas) == "".join(again.deltas)
    assert (await get(url, "/is_paused"))["is_paused"] is False


async def test_abort_ends_what_runs_and_wait_lets_it_finish(url):
    stream = Stream(url, max_tokens=120, request_id="op-abort")
    await stream.until(3)
    answer = (await post(url, "/pause", mode="abort")).json()
    assert answer["aborted"] == 1
    await asyncio.wait_for(stream.task, 30)
    # It ended there (the API says "stop" for a request the engine aborted).
    assert stream.finish_reason == "stop" and stream.usage["completion_tokens"] < 120
    await post(url, "/resume")

    stream = Stream(url, max_tokens=30, request_id="op-wait")
    await stream.until(2)
    answer = (await post(url, "/pause", mode="wait")).json()
    await asyncio.wait_for(stream.task, 10)  # its last chunks were on their way
    assert stream.finish_reason == "length"  # it ran to its end before the pause answered
    assert answer["aborted"] == 0 and stream.usage["completion_tokens"] == 30
    late = Stream(url, max_tokens=3, request_id="op-after-wait")
    await asyncio.sleep(10 * STEP_S)
    assert late.deltas == []
    await post(url, "/resume")
    await asyncio.wait_for(late.task, 30)
    assert late.usage["completion_tokens"] == 3


async def test_sleep_releases_the_ranks_and_wake_up_brings_them_back(url):
    before = await rank_pids(APP)
    stream = Stream(url, max_tokens=60, request_id="op-sleep")
    await stream.until(3)
    answer = (await post(url, "/sleep", level="1", mode="keep")).json()
    assert answer == {"status": "sleeping", "level": 1, "num_engine_replicas": 2}
    assert (await get(url, "/is_sleeping"))["is_sleeping"] is True
    for pids in before:
        assert not any(psutil.pid_exists(pid) for pid in pids)  # their memory went with them
    assert (await post(url, "/resume")).status_code == 409  # asleep: wake up first
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        assert (await client.get("/health")).status_code == 200  # asleep is not sick
    seen = len(stream.deltas)  # (the health call gave the last sent chunks their time)
    await asyncio.sleep(20 * STEP_S)
    assert len(stream.deltas) == seen
    assert (await post(url, "/wake_up")).json() == {"status": "awake", "num_engine_replicas": 2}
    await asyncio.wait_for(stream.task, 120)
    assert stream.usage["completion_tokens"] == 60 and stream.finish_reason == "length"
    again = Stream(url, max_tokens=60, request_id="op-sleep")
    await again.task
    assert "".join(stream.deltas) == "".join(again.deltas)  # recomputed, nothing lost
    after = await rank_pids(APP)
    assert all(set(a).isdisjoint(b) for a, b in zip(after, before, strict=True))
    assert (await get(url, "/is_sleeping"))["is_sleeping"] is False
    for stats in await engine_replicas(APP, "stats"):
        assert stats["sleeping"] is False and stats["paused"] is False
