"""Faults seen through the HTTP server: a killed rank, a killed scheduler actor
(the EngineServer replica), a hung rank. Every wait is bounded; every request
ends — with its full, unchanged output or with a clear error, never a hang.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import httpx
import pytest

from iterserve.scheduler import FakeExecutor, SamplingParams
from iterserve.workers.tokenizer import Tokenizer
from tests.reliability.conftest import idle_replicas, replica_pids, wait_for
from tests.serve.conftest import (
    MODEL,
    assert_engines_sound,
    deploy,
    fake_engine,
    rank_pids,
    sse_events,
    undeploy,
)

HANG_GUARD_S = 180  # a request that never ends fails here instead of blocking the run
NUM_IN_FLIGHT = 32


@pytest.fixture(scope="module")
def peaked_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint with its final norm scaled up: peaked logits, so greedy
    choices never hinge on near-ties that a recompute's different batching could flip."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("faults") / "tiny-llama"
    shutil.copytree(tiny_model_dir, path)
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 8.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


async def step_of(client: httpx.AsyncClient) -> int:
    return (await client.get("/v1/stats")).json()["replicas"][0].get("step", 0)


@pytest.fixture
def model_url(serve_url, peaked_model_dir):
    config = dict(
        dtype="float32",
        kernel_backend="torch",
        max_model_len=128,
        num_kv_blocks=512,
        block_size=4,
        max_num_seqs=NUM_IN_FLIGHT,
        max_num_batched_tokens=512,
        num_cpus_per_worker=0.1,
        torch_threads=1,
    )
    yield deploy(serve_url, "kill-worker", model=str(peaked_model_dir), config=config)
    undeploy("kill-worker")


async def test_a_killed_rank_is_replaced_and_32_requests_finish_unchanged(model_url):
    app, url = "kill-worker", model_url
    bodies = [
        {"model": "tiny-llama", "prompt": [1, 5 + i, 9, 40 + i], "max_tokens": 48}
        | {"temperature": 0, "ignore_eos": True}
        for i in range(NUM_IN_FLIGHT)
    ]
    async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:

        async def run_all():
            replies = await asyncio.gather(
                *(client.post("/v1/completions", json=b) for b in bodies)
            )
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            return [r.json()["choices"][0]["text"] for r in replies]

        reference = await run_all()  # fault-free
        (pids,) = await rank_pids(app)
        (replica_pid,) = replica_pids(app, "EngineServer")
        start = await step_of(client)
        run = asyncio.ensure_future(run_all())
        assert await wait_for(lambda: _past(client, start + 3), 60, 0.005)
        os.kill(pids[0], signal.SIGKILL)
        killed_at = time.monotonic()
        # Health pings see the dead rank too: the group must still restart only once.
        probes = await asyncio.gather(*(client.get("/health") for _ in range(3)))
        texts = await asyncio.wait_for(run, HANG_GUARD_S)
        print(f"\nworker killed; 32 requests finished {time.monotonic() - killed_at:.1f} s later")
        assert texts == reference
        (replica,) = await idle_replicas(client)
        assert replica["rank_restarts"] == 1 and replica["kv_blocks_used"] == 0
        assert replica["num_recomputed_tokens"] > 0
        assert {r.status_code for r in probes} <= {200, 503}
        assert (await client.get("/health")).status_code == 200
    assert replica_pids(app, "EngineServer") == [replica_pid]  # Serve kept the replica
    (new_pids,) = await rank_pids(app)
    assert set(new_pids).isdisjoint(pids)
    await assert_engines_sound(app)


async def _past(client: httpx.AsyncClient, step: int) -> bool:
    return await step_of(client) >= step


@pytest.fixture
def fake_url(request, serve_url, tokenizer_dir, vocab_size):
    """A fake-executor app; ``request.param``: (app name, config overrides, app args)."""
    app, overrides, args = request.param
    config = fake_engine(vocab_size, **overrides)
    yield app, deploy(serve_url, app, model=str(tokenizer_dir), config=config, **args)
    undeploy(app)


SLOW = {"executor_options": {"output_len": None, "step_sleep_s": 0.02}}


@pytest.mark.parametrize(
    "fake_url", [("kill-scheduler", SLOW, {"health_check_period_s": 1})], indirect=True
)
async def test_a_killed_scheduler_fails_its_requests_and_serve_brings_it_back(fake_url):
    app, url = fake_url
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 100}
    async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
        (old_pid,) = replica_pids(app, "EngineServer")

        async def stream():
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                return r.status_code, sse_events([line async for line in r.aiter_lines()])

        streams = [asyncio.ensure_future(stream()) for _ in range(4)]
        posts = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(4)]
        assert await wait_for(lambda: _past(client, 5), 60, 0.01)
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for status, events in await asyncio.wait_for(asyncio.gather(*streams), 60):
            assert status == 200 and events[-1]["error"]["code"] == "engine_unavailable"
        for r in await asyncio.wait_for(asyncio.gather(*posts), 60):
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
            assert int(r.headers["retry-after"]) >= 1
        failed_s = time.monotonic() - killed_at

        async def health(status: int):
            r = await client.get("/health")
            return r if r.status_code == status else None

        down = await wait_for(lambda: health(503), 30)
        assert down is not None and down.json()["error"]["code"] == "engine_unhealthy"
        assert await wait_for(lambda: health(200), 120, 0.25), "Serve did not bring it back"
        back_s = time.monotonic() - killed_at
        r = await client.post("/v1/completions", json={**body, "max_tokens": 8})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        (replica,) = await idle_replicas(client)
        assert replica["slots_used"] == 0 and replica["kv_blocks_used"] == 0
    (new_pid,) = replica_pids(app, "EngineServer")
    assert new_pid != old_pid
    print(
        f"\nscheduler killed: requests failed within {failed_s:.1f} s, served again after {back_s:.1f} s"
    )


def _bug_once(tmp_dir: str) -> dict:
    """A replica whose step 5 result is malformed, once: a ProtocolError in the loop."""
    return {
        "executor": "faulty",
        "executor_options": {
            "output_len": None,
            "step_sleep_s": 0.02,
            "fault_bad_result_at_step": 5,
            "fault_once_file": os.path.join(tmp_dir, "bug-fired"),
        },
    }


@pytest.fixture
def bug_url(serve_url, tokenizer_dir, vocab_size, tmp_path):
    config = fake_engine(vocab_size, **_bug_once(str(tmp_path)))
    app = "engine-bug"
    yield (
        app,
        deploy(serve_url, app, model=str(tokenizer_dir), config=config, health_check_period_s=1),
    )
    undeploy(app)


async def test_an_engine_bug_fails_every_request_at_once_and_serve_replaces_the_replica(bug_url):
    """Not a rank failure but a bug in the loop (here: a result that contradicts
    the scheduler). Every request in flight ends at once with a 503-class error,
    /health says 503 within a health period, and Serve replaces the replica."""
    app, url = bug_url
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 100}
    async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
        (old_pid,) = replica_pids(app, "EngineServer")

        async def stream():
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                return r.status_code, sse_events([line async for line in r.aiter_lines()])

        started = time.monotonic()
        streams = [asyncio.ensure_future(stream()) for _ in range(3)]
        posts = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(3)]
        # 100 tokens at 20 ms a step take 2 s: a request that has not ended well
        # before the request timeout (600 s) is hanging behind the bug.
        for status, events in await asyncio.wait_for(asyncio.gather(*streams), 60):
            assert status == 200 and events[-1]["error"]["code"] == "engine_unavailable"
            assert "ProtocolError" in events[-1]["error"]["message"]
        for r in await asyncio.wait_for(asyncio.gather(*posts), 60):
            assert r.status_code == 503, r.text
            assert "ProtocolError" in r.json()["error"]["message"]
        failed_s = time.monotonic() - started

        async def health(status: int):
            r = await client.get("/health")
            return r if r.status_code == status else None

        down = await wait_for(lambda: health(503), 2)  # one health period
        assert down is not None and "ProtocolError" in down.json()["error"]["message"]
        assert await wait_for(lambda: health(200), 120, 0.25), "Serve did not replace it"
        r = await client.post("/v1/completions", json={**body, "max_tokens": 8})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert replica_pids(app, "EngineServer") != [old_pid]
    print(f"\nengine bug: requests failed within {failed_s:.1f} s of starting")


HANG = {
    "step_timeout_s": 2.0,
    "max_restarts": 1,
    "executor": "faulty",
    "executor_options": {"output_len": None, "step_sleep_s": 0.01, "fault_hang_at_step": 3},
}


@pytest.mark.parametrize(
    "fake_url", [("hang", HANG, {"health_check_period_s": 600})], indirect=True
)
async def test_a_hung_rank_is_replaced_then_a_dead_one_past_the_restarts_fails_clearly(
    fake_url, tokenizer_dir, vocab_size
):
    """One restart allowed: the hang at step 3 uses it (the step timeout catches it,
    the request still completes); the rank killed afterwards cannot be replaced,
    so the requests in flight end with 503 / an error event and /health says 503."""
    app, url = fake_url
    async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
        headers = {"X-Request-Id": "hung"}
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 20}
        r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        fake = FakeExecutor(vocab_size=vocab_size, output_len=None)
        tokens, _ = fake.expected_output("hung-0", SamplingParams(max_tokens=20))
        assert r.json()["choices"][0]["text"] == Tokenizer(tokenizer_dir).decode(tokens)
        (replica,) = await idle_replicas(client)
        assert replica["rank_restarts"] == 1

        (pids,) = await rank_pids(app)
        long = {**body, "max_tokens": 100}
        stream = client.stream("POST", "/v1/completions", json={**long, "stream": True})
        post = asyncio.ensure_future(client.post("/v1/completions", json=long))
        async with stream as s:
            start = await step_of(client)
            assert await wait_for(lambda: _past(client, start + 2), 60, 0.01)
            os.kill(pids[0], signal.SIGKILL)
            events = sse_events([line async for line in s.aiter_lines()])
        assert "could not be restarted" in events[-1]["error"]["message"]
        r = await asyncio.wait_for(post, 60)
        assert r.status_code == 503 and "could not be restarted" in r.json()["error"]["message"]
        health = await client.get("/health")
        assert health.status_code == 503 and "could not be restarted" in health.text
        (replica,) = await idle_replicas(client)
        assert replica["slots_used"] == 0 and replica["kv_blocks_used"] == 0
