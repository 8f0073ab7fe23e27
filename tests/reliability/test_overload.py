"""Five times the engine's capacity for a bounded time, against a bounded queue.

Capacity is measured first (requests/s the fake engine completes with a fixed
step sleep, offered by a closed loop that keeps every slot and the queue busy).
Then an open loop offers 5x that, in two bursts. Beyond capacity the server may
only answer 429 (queue full) or 503 (the ingress's bounded queue is full); no
accepted request may time out; the replica's and the ingress's resident memory
stay flat after the first burst's warm-up, through the second burst; and once
the load stops a normal request is served within seconds and the engine is idle.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from tests.reliability.conftest import idle_replicas, replica_pids, rss_bytes, wait_for
from tests.serve.conftest import MODEL, deploy, fake_engine, undeploy

APP = "overload"
MAX_NUM_SEQS = 4
MAX_QUEUE_LEN = 8
REQUEST_TIMEOUT_S = 10.0
MEASURE_S = 4.0
OVERLOAD_S = 12.0
WARMUP_S = 4.0  # RSS is compared with its value at the end of this part of the overload
BURSTS = 2  # a pile-up that outlives a burst shows as growth in the next one
BODY = {"model": MODEL, "prompt": "overload", "max_tokens": 8}


@pytest.fixture(scope="module")
def overload_url(serve_url, tokenizer_dir, vocab_size):
    config = fake_engine(
        vocab_size,
        max_num_seqs=MAX_NUM_SEQS,
        max_queue_len=MAX_QUEUE_LEN,
        executor_options={"output_len": None, "step_sleep_s": 0.02},
    )
    yield deploy(
        serve_url,
        APP,
        model=str(tokenizer_dir),
        config=config,
        request_timeout_s=REQUEST_TIMEOUT_S,
    )
    undeploy(APP)


async def measure_capacity(client: httpx.AsyncClient) -> float:
    """Completed requests/s with every slot and the queue kept full (closed loop)."""
    done = 0
    deadline = time.monotonic() + MEASURE_S

    async def worker():
        nonlocal done
        while time.monotonic() < deadline:
            r = await client.post("/v1/completions", json=BODY)
            if r.status_code == 200:
                done += 1
            else:
                await asyncio.sleep(0.01)

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(MAX_NUM_SEQS + MAX_QUEUE_LEN)))
    return done / (time.monotonic() - started)


async def offer(client: httpx.AsyncClient, rate: float, pids: list[int]):
    """Open loop: a request every 1/rate s for OVERLOAD_S, whatever came back.
    Returns the statuses and the RSS samples (one a second) of the server's processes."""
    statuses: Counter = Counter()
    samples: list[tuple[float, int]] = []

    async def one():
        try:
            r = await client.post("/v1/completions", json=BODY)
            statuses[r.status_code] += 1
        except httpx.TimeoutException:
            statuses["client timeout"] += 1

    tasks = []
    started = time.monotonic()
    next_sample = started
    for i in range(int(rate * OVERLOAD_S)):
        now = time.monotonic()
        if now >= next_sample:
            samples.append((now - started, rss_bytes(pids)))
            next_sample += 1.0
        await asyncio.sleep(max(0.0, started + i / rate - now))
        tasks.append(asyncio.ensure_future(one()))
    await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_TIMEOUT_S + 60)
    samples.append((time.monotonic() - started, rss_bytes(pids)))
    return statuses, samples


async def test_five_times_capacity_is_refused_cleanly_and_memory_stays_flat(overload_url):
    pids = replica_pids(APP, "EngineServer") + replica_pids(APP, "OpenAIIngress")
    assert len(pids) == 2
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    timeout = REQUEST_TIMEOUT_S + 30  # longer than the server's: it must answer first
    async with httpx.AsyncClient(base_url=overload_url, timeout=timeout, limits=limits) as client:
        capacity = await measure_capacity(client)
        rss_idle = rss_bytes(pids)
        statuses, samples = await offer(client, 5 * capacity, pids)
        for _ in range(BURSTS - 1):
            more_statuses, more_samples = await offer(client, 5 * capacity, pids)
            statuses += more_statuses
            samples += [(t + OVERLOAD_S, rss) for t, rss in more_samples]
        stopped = time.monotonic()

        async def served():
            r = await client.post("/v1/completions", json=BODY)
            return r.status_code == 200

        assert await wait_for(served, 30, 0.2), "no service after the load stopped"
        recovered_s = time.monotonic() - stopped
        (replica,) = await idle_replicas(client)

    warm = next(rss for t, rss in samples if t >= WARMUP_S)
    peak = max(rss for t, rss in samples if t >= WARMUP_S)
    print(
        f"\ncapacity {capacity:.1f} req/s; offered {5 * capacity:.1f} req/s for {OVERLOAD_S:.0f} s;"
        f" in {BURSTS} bursts; statuses {dict(statuses)}; RSS (replica + ingress) idle {rss_idle >> 20} MiB,"
        f" after warm-up {warm >> 20} MiB, peak {peak >> 20} MiB, end {samples[-1][1] >> 20} MiB;"
        f" served again {recovered_s:.2f} s after the load stopped"
    )
    assert set(statuses) <= {200, 429, 503}, statuses
    assert statuses[200] > 0 and statuses[429] > 0, statuses
    assert peak <= 1.2 * warm, (warm, peak)
    assert replica["counters"]["rejected_queue_full"] >= statuses[429]
    assert replica["slots_used"] == 0 and replica["kv_blocks_used"] == 0
    assert replica["num_running"] == 0 and replica["num_waiting"] == 0
