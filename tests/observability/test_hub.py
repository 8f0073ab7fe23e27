"""The MetricsHub actor on the session's Ray instance."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import ray

from iterserve.cluster.metrics.hub import get_or_create_hub, push_periodically, render


@pytest.fixture
def hub_name(ray_session):
    name = f"metrics-hub-test-{uuid.uuid4().hex[:8]}"
    yield name
    # Detached actors outlive their creator: remove the test's one explicitly.
    ray.kill(get_or_create_hub(name))


def test_hub_merges_what_engines_push(hub_name, busy_metrics):
    hub = get_or_create_hub(hub_name)
    same = get_or_create_hub(hub_name)  # a second caller finds the same actor
    ray.get(hub.push.remote("demo/0", busy_metrics("demo", 0).snapshot()))
    ray.get(same.push.remote("demo/1", busy_metrics("demo", 1).snapshot()))
    text = render(ray.get(hub.collect.remote())).decode()
    assert 'iterserve_requests_running{engine="0",model_name="demo"}' in text
    assert 'iterserve_requests_running{engine="1",model_name="demo"}' in text
    assert text.count("# TYPE iterserve_requests_running gauge") == 1
    ray.get(hub.remove.remote("demo/1"))
    assert len(ray.get(hub.collect.remote())) == 1


async def test_push_periodically_keeps_the_hub_current(hub_name, busy_metrics):
    metrics = busy_metrics("demo", 2)
    task = asyncio.create_task(
        push_periodically(metrics, "demo/2", hub_name=hub_name, interval_s=0.05)
    )
    hub = get_or_create_hub(hub_name)
    try:
        for _ in range(200):  # bounded: 10 s at most
            snapshots = await hub.collect.remote()
            if snapshots:
                break
            await asyncio.sleep(0.05)
        assert snapshots == [metrics.snapshot()]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
