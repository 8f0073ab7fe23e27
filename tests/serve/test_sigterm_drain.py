"""``iterserve serve`` with the demo model drains on SIGTERM: 16 streams of 128
tokens each, SIGTERM once every one of them is under way, and every stream still
completes with all its tokens; requests that arrive during the drain get 200
(taken before the drain began) or 503 with Retry-After, never a cut connection;
then the server exits. Run as a user runs it: a subprocess with Ray of its own."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import httpx

from tests.serve.conftest import stream_completion
from tests.test_quickstart import EXIT_TIMEOUT_S, _start_serve, _wait_healthy

NUM_STREAMS = 16
MAX_TOKENS = 128


async def _stream(client: httpx.AsyncClient, i: int, started: asyncio.Event, counts: list[int]):
    body = {
        "model": "demo",
        "prompt": f"Story number {i}:",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def count(events: list) -> bool:
        counts[i] = len(events)
        if all(counts):
            started.set()
        return False

    return await stream_completion(client, body, on_event=count)


async def _load(url: str, proc: subprocess.Popen) -> tuple[list, list[tuple[int, str | None]]]:
    limits = httpx.Limits(max_connections=NUM_STREAMS + 4)
    counts = [0] * NUM_STREAMS
    started = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        streams = [
            asyncio.create_task(_stream(client, i, started, counts)) for i in range(NUM_STREAMS)
        ]
        await asyncio.wait_for(started.wait(), 300)
        proc.send_signal(signal.SIGTERM)
        during: list[tuple[int, str | None]] = []
        body = {"model": "demo", "prompt": "late", "max_tokens": 4}
        async with httpx.AsyncClient(base_url=url, timeout=60) as late:
            while not all(s.done() for s in streams):
                r = await late.post("/v1/completions", json=body)
                during.append((r.status_code, r.headers.get("retry-after")))
                await asyncio.sleep(0.1)
        return await asyncio.gather(*streams), during


def test_sigterm_mid_stream_completes_every_stream(tmp_path):
    proc, url, log = _start_serve(tmp_path)
    try:
        _wait_healthy(url, proc, log)
        results, during = asyncio.run(_load(url, proc))
        for events, done in results:
            assert done, events[-2:]
            assert not any("error" in e for e in events), [e for e in events if "error" in e]
            assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
            finishes = [c["finish_reason"] for e in events for c in e["choices"]]
            assert finishes[-1] == "length"
        refused = [(status, retry) for status, retry in during if status != 200]
        assert all(status == 503 and retry for status, retry in refused), during
        proc.wait(EXIT_TIMEOUT_S + 30)
        text = log.read_text()
        assert "draining" in text and "drained: " in text, text[-2000:]
        print(f"\nduring the drain: {len(during)} new requests, {len(refused)} refused with 503")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
