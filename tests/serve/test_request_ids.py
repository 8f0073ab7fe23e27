"""Client request ids are names, not identities: two requests may share one."""

from __future__ import annotations

import asyncio

import httpx

from tests.serve.conftest import AUTH, MODEL


async def test_concurrent_requests_with_the_same_request_id_are_both_served(api_url):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 6}
    headers = {**AUTH, "X-Request-Id": "same-id"}
    async with httpx.AsyncClient(base_url=api_url, timeout=60, headers=headers) as client:
        streamed = client.stream("POST", "/v1/completions", json={**body, "stream": True})
        async with streamed as first:
            # The first is still open while the second, with the same id, runs whole.
            second = await client.post("/v1/completions", json=body)
            events = [line async for line in first.aiter_lines() if line.startswith("data: {")]
        assert first.status_code == 200 and events
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["completion_tokens"] == 6
        assert second.headers["x-request-id"] == "same-id"


async def test_many_requests_sharing_one_id_each_get_their_own_output(api_url):
    headers = {**AUTH, "X-Request-Id": "shared"}
    async with httpx.AsyncClient(base_url=api_url, timeout=60, headers=headers) as client:
        replies = await asyncio.gather(*(
            client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": n})
            for n in range(1, 9)
        ))  # fmt: skip
    assert [r.status_code for r in replies] == [200] * 8
    assert [r.json()["usage"]["completion_tokens"] for r in replies] == list(range(1, 9))
