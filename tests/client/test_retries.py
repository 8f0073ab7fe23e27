"""Retries: only connection failures and 429/503, never once a stream has begun."""

from __future__ import annotations

import dataclasses

import pytest
from iterserve_client import (
    APIConnectionError,
    APITimeoutError,
    BadRequestError,
    InternalServerError,
    RateLimitError,
    RetryPolicy,
    ServiceUnavailableError,
)

from tests.client.stub import (
    closed_port,
    dropping_sse_reply,
    error_reply,
    json_reply,
    slow_reply,
    sse_reply,
)
from tests.client.util import collect, resolve

COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
CHUNK = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CountingPolicy(RetryPolicy):
    """Records each failure the client asked about."""

    failures: list = dataclasses.field(default_factory=list)

    def next_delay(self, attempt, failure):
        self.failures.append(failure)
        return super().next_delay(attempt, failure)


def complete(client):
    return resolve(client.completions.create(model="m", prompt="hi"))


@pytest.mark.parametrize("status", [503, 429])
async def test_retryable_status_then_success(make_client, stub, status):
    stub.add(error_reply(status, "busy", retry_after="0"), json_reply(200, COMPLETION))
    out = await complete(make_client())
    assert out.choices[0].text == "ok"
    assert len(stub.requests) == 2


@pytest.mark.parametrize("status, error", [(503, ServiceUnavailableError), (429, RateLimitError)])
async def test_gives_up_after_max_retries(make_client, stub, status, error):
    stub.add(*[error_reply(status, "busy", retry_after="0")] * 5)
    with pytest.raises(error):
        await complete(make_client(max_retries=2))
    assert len(stub.requests) == 3


@pytest.mark.parametrize("status, error", [(400, BadRequestError), (500, InternalServerError)])
async def test_other_statuses_are_not_retried(make_client, stub, status, error):
    stub.add(error_reply(status, "no"), json_reply(200, COMPLETION))
    with pytest.raises(error):
        await complete(make_client(max_retries=3))
    assert len(stub.requests) == 1


async def test_max_retries_zero_does_not_retry(make_client, stub):
    stub.add(error_reply(503, "down", retry_after="0"), json_reply(200, COMPLETION))
    with pytest.raises(ServiceUnavailableError):
        await complete(make_client(max_retries=0))
    assert len(stub.requests) == 1


async def test_connection_refused_is_retried_then_raised(make_client):
    client = make_client(f"http://127.0.0.1:{closed_port()}")
    client.retry = CountingPolicy(max_retries=2, backoff_base=0.001, backoff_max=0.01)
    with pytest.raises(APIConnectionError) as info:
        await complete(client)
    assert info.value.status_code is None
    assert len(client.retry.failures) == 3  # the first try and two retries


async def test_read_timeout_is_not_retried(make_client, stub):
    stub.add(slow_reply(1.0, json_reply(200, COMPLETION)), json_reply(200, COMPLETION))
    with pytest.raises(APITimeoutError):
        await complete(make_client(timeout=0.2, max_retries=3))
    assert len(stub.requests) == 1


async def test_stream_is_retried_before_its_first_byte(make_client, stub):
    stub.add(error_reply(503, "starting", retry_after="0"), sse_reply([CHUNK, CHUNK]))
    stream = await resolve(make_client().completions.create(model="m", prompt="hi", stream=True))
    assert [c.choices[0].text for c in await collect(stream)] == ["a", "a"]
    assert len(stub.requests) == 2


async def test_stream_cut_after_first_byte_raises_and_is_not_retried(make_client, stub):
    stub.add(dropping_sse_reply([CHUNK]), sse_reply([CHUNK]))
    stream = await resolve(
        make_client(max_retries=3).completions.create(model="m", prompt="hi", stream=True)
    )
    seen = []
    with pytest.raises(APIConnectionError, match="broke off"):
        if hasattr(stream, "__aiter__"):
            async for chunk in stream:
                seen.append(chunk)
        else:
            for chunk in stream:
                seen.append(chunk)
    assert len(seen) == 1
    assert len(stub.requests) == 1
    assert stream.closed


def test_backoff_is_full_jitter_capped():
    policy = RetryPolicy(max_retries=5, backoff_base=0.5, backoff_max=4.0)
    for attempt, bound in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (6, 4.0)]:
        delays = [policy.delay(attempt) for _ in range(200)]
        assert all(0.0 <= d <= bound for d in delays)
        assert max(delays) > bound / 2  # spread over the interval, not a constant


def test_retry_after_is_honoured_and_capped():
    policy = RetryPolicy(backoff_max=8.0)
    assert policy.delay(0, retry_after=3.0) == 3.0
    assert policy.delay(0, retry_after=120.0) == 8.0
    error = ServiceUnavailableError("down", status_code=503, retry_after=2.0)
    assert policy.next_delay(0, error) == 2.0
    assert policy.next_delay(2, error) is None  # max_retries=2 spent
    assert policy.next_delay(0, BadRequestError("bad", status_code=400)) is None


def test_negative_max_retries_is_refused():
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)
