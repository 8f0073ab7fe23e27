"""Replicas that die or stop cost no request.

A dead engine replica (its rank killed, no restart allowed) among three: every
request of a load that follows succeeds, under load routing and prefix routing,
the one it had accepted included. A redeploy with a changed engine config while
streams run and new requests arrive: every stream completes token for token and
every new request succeeds, while every old replica drains and stops.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from iterserve.scheduler import FakeExecutor, SamplingParams
from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import MODEL, deploy, engine_replicas, fake_engine, rank_pids, undeploy


@pytest.mark.parametrize("routing", ["load", "prefix"])
async def test_a_dead_replica_among_three_fails_no_request(
    serve_url, tokenizer_dir, vocab_size, routing
):
    app = f"dead-{routing}"
    config = fake_engine(
        vocab_size,
        max_restarts=0,
        executor_options={"output_len": None, "step_sleep_s": 0.005},
    )
    url = await asyncio.to_thread(
        deploy,
        serve_url,
        app,
        model=str(tokenizer_dir),
        config=config,
        num_engine_replicas=3,
        routing=routing,
        health_check_period_s=600,  # Serve must not replace it during the test
    )
    try:
        pids = await rank_pids(app)
        os.kill(pids[0][0], signal.SIGKILL)  # one replica's only rank: it cannot restart
        body = {"model": MODEL, "prompt": "the same system prompt, then", "max_tokens": 8}
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            for _ in range(3):  # load after load: the dead replica is never chosen again
                responses = await asyncio.gather(
                    *(client.post("/v1/completions", json=body) for _ in range(30))
                )
                failed = [r.text for r in responses if r.status_code != 200]
                assert not failed, failed[:3]
        states = [s.get("state") for s in await engine_replicas(app, "stats")]
        assert sorted(states) == ["dead", "serving", "serving"], states
    finally:
        await asyncio.to_thread(undeploy, app)


async def _stream(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[str, bool]:
    body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": max_tokens, "stream": True}
    text, done = "", False
    async with client.stream(
        "POST", "/v1/completions", json=body, headers={"X-Request-Id": f"s{i}"}
    ) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                text += event["choices"][0]["text"]
    return text, done


async def test_a_redeploy_with_a_changed_config_under_load_loses_no_request(
    serve_url, tokenizer_dir, vocab_size
):
    app = "redeploy"
    options = {"output_len": None, "step_sleep_s": 0.01}
    args = dict(model=str(tokenizer_dir), num_engine_replicas=2)
    url = await asyncio.to_thread(
        deploy,
        serve_url,
        app,
        config=fake_engine(vocab_size, max_num_seqs=8, executor_options=options),
        **args,
    )
    port = int(url.rsplit(":", 1)[1])
    max_tokens = 80
    try:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            streams = [asyncio.create_task(_stream(client, i, max_tokens)) for i in range(16)]
            await asyncio.sleep(0.3)  # mid-stream
            redeploy = asyncio.create_task(
                asyncio.to_thread(
                    deploy,
                    serve_url,
                    app,
                    config=fake_engine(vocab_size, max_num_seqs=6, executor_options=options),
                    http_port=port,
                    **args,
                )
            )
            statuses: list[int | str] = []
            body = {"model": MODEL, "prompt": "during", "max_tokens": 4}
            # New requests all through the change, each on a connection of its own.
            async with httpx.AsyncClient(base_url=url, timeout=120) as fresh:
                while not redeploy.done():
                    try:
                        r = await fresh.post(
                            "/v1/completions", json=body, headers={"Connection": "close"}
                        )
                        statuses.append(r.status_code if r.status_code == 200 else r.text)
                    except httpx.HTTPError as exc:
                        statuses.append(repr(exc))
                    await asyncio.sleep(0.05)
            await redeploy
            results = await asyncio.gather(*streams, return_exceptions=True)
        tok = Tokenizer(tokenizer_dir)
        fake = FakeExecutor(vocab_size=vocab_size, output_len=None)
        params = SamplingParams(max_tokens=max_tokens)
        assert statuses and set(statuses) == {200}, statuses
        for i, result in enumerate(results):
            assert not isinstance(result, BaseException), (i, result)
            text, done = result
            assert done
            assert text == tok.decode(fake.expected_output(f"s{i}-0", params)[0]), i
        infos = await engine_replicas(app, "stats")
        assert [s["slots_total"] for s in infos] == [6, 6]  # the new config serves
    finally:
        await asyncio.to_thread(undeploy, app)
