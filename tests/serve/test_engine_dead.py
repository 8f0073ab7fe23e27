"""An engine whose ranks die for good: 503 with Retry-After, and /health says so.

The fake worker crashes its process at step 3 and the engine may not restart
it (``max_restarts=0``), so the engine is dead from then on. Serve's own
health check would replace the replica; its period is long here so the dead
engine stays observable.
"""

from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import MODEL, deploy, fake_engine, undeploy

APP = "dead"


@pytest.fixture(scope="module")
def dead_url(serve_url, tokenizer_dir, vocab_size):
    config = fake_engine(
        vocab_size,
        max_restarts=0,
        step_timeout_s=10.0,
        executor="faulty",
        executor_options={"output_len": None, "fault_crash_at_step": 3},
    )
    yield deploy(serve_url, APP, model=str(tokenizer_dir), config=config, health_check_period_s=600)
    undeploy(APP)


def test_requests_on_a_dead_engine_are_503_with_retry_after(dead_url):
    with httpx.Client(base_url=dead_url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 20}
        # The request in flight when the worker dies fails as unavailable.
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unavailable"
        # Every later request is refused before it reaches the scheduler.
        for path, extra in (
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            r = client.post(path, json={"model": MODEL, **extra})
            assert r.status_code == 503, r.text
            assert int(r.headers["retry-after"]) >= 1
            assert "could not be restarted" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 503
        health = client.get("/health")
        assert health.status_code == 503 and "retry-after" in health.headers
        error = health.json()["error"]
        assert (
            error["code"] == "engine_unhealthy"
            and "1 of 1 engine replicas not serving" in error["message"]
        )
