"""The dead-replica retry with the demo model: two engine replicas, one rank
killed while idle (no restart allowed), then 16 streams of 128 tokens: every
one completes with all its tokens, those first sent to the dead replica moved
to the live one before their first token.

The two replicas share this machine's two cores: each rank reserves half a CPU
(Ray is told the machine's true count; the reservation is what shrinks)."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx

from iterserve.models import DEMO_MODEL_PATH
from tests.serve.conftest import deploy, engine_replicas, rank_pids, stream_completion, undeploy

APP = "dead-real"
NUM_STREAMS, MAX_TOKENS = 16, 128


async def _stream(client: httpx.AsyncClient, i: int):
    body = {"model": "demo", "prompt": f"Story number {i}:", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    events, done = await stream_completion(client, body)
    assert done, f"stream {i} ended without [DONE]"
    return events


async def test_streams_sent_to_a_dead_replica_of_the_demo_model_complete_elsewhere(serve_url):
    config = {"max_restarts": 0, "num_cpus_per_worker": 0.5, "max_num_seqs": 16,
              "max_model_len": 512, "num_kv_blocks": 256}  # fmt: skip
    url = await asyncio.to_thread(
        deploy, serve_url, APP, model=str(DEMO_MODEL_PATH), config=config,
        num_engine_replicas=2, routing="load", health_check_period_s=600,
    )  # fmt: skip
    try:
        pids = await rank_pids(APP)
        os.kill(pids[0][0], signal.SIGKILL)
        limits = httpx.Limits(max_connections=NUM_STREAMS + 4)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            results = await asyncio.gather(*(_stream(client, i) for i in range(NUM_STREAMS)))
        for events in results:
            assert not [e for e in events if "error" in e]
            assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        states = sorted(s.get("state") for s in await engine_replicas(APP, "stats"))
        assert states == ["dead", "serving"], states
    finally:
        await asyncio.to_thread(undeploy, APP)
