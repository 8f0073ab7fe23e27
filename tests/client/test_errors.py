"""Each HTTP status raises its own error type, carrying message, request id and body."""

from __future__ import annotations

import builtins

import iterserve_client
import pytest
from iterserve_client import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from iterserve_client.errors import parse_retry_after

from tests.client.stub import error_reply, json_reply, sse_reply
from tests.client.util import collect, resolve

CASES = [
    (400, BadRequestError),
    (401, AuthenticationError),
    (404, NotFoundError),
    (413, PayloadTooLargeError),
    (422, UnprocessableEntityError),
    (429, RateLimitError),
    (500, InternalServerError),
    (502, InternalServerError),
    (503, ServiceUnavailableError),
    (504, InternalServerError),
    (409, APIError),
]


@pytest.mark.parametrize("status, error", CASES)
async def test_status_maps_to_error_type(make_client, stub, status, error):
    stub.add(
        error_reply(status, f"failed with {status}", request_id="req-7", param="prompt", code="c")
    )
    with pytest.raises(error) as info:
        await resolve(make_client(max_retries=0).completions.create(model="m", prompt="x"))
    exc = info.value
    assert type(exc) is error
    assert exc.status_code == status
    assert exc.message == f"failed with {status}"
    assert exc.request_id == "req-7"
    assert (exc.param, exc.code, exc.type) == ("prompt", "c", "x")
    assert exc.body["error"]["message"] == exc.message
    assert "req-7" in str(exc) and str(status) in str(exc)


@pytest.mark.parametrize("status", [413, 422])
def test_payload_and_validation_errors_are_bad_requests(status):
    assert issubclass(iterserve_client.errors.error_class(status), BadRequestError)


async def test_request_id_falls_back_to_the_error_body(make_client, stub):
    stub.add(json_reply(400, {"error": {"message": "bad", "request_id": "req-body"}}))
    with pytest.raises(BadRequestError) as info:
        await resolve(make_client().completions.create(model="m", prompt="x"))
    assert info.value.request_id == "req-body"


@pytest.mark.parametrize("status, error", [(429, RateLimitError), (503, ServiceUnavailableError)])
async def test_retry_after_is_parsed(make_client, stub, status, error):
    stub.add(error_reply(status, "later", retry_after="7"))
    with pytest.raises(error) as info:
        await resolve(make_client(max_retries=0).completions.create(model="m", prompt="x"))
    assert info.value.retry_after == 7.0


async def test_error_body_that_is_not_openai_shaped(make_client, stub):
    stub.add(json_reply(502, b"<html>bad gateway</html>"))
    with pytest.raises(InternalServerError) as info:
        await resolve(make_client(max_retries=0).models())
    assert "bad gateway" in info.value.message
    assert info.value.request_id is None


async def test_error_event_inside_a_stream_raises_its_type(make_client, stub):
    chunk = {"id": "c", "choices": [{"index": 0, "text": "a"}]}
    error = {"error": {"message": "workers lost", "type": "service_unavailable_error"}}
    stub.add(sse_reply([chunk, error], request_id="req-s"))
    stream = await resolve(make_client().completions.create(model="m", prompt="x", stream=True))
    with pytest.raises(ServiceUnavailableError, match="workers lost") as info:
        await collect(stream)
    assert info.value.request_id == "req-s"


def test_retry_after_formats():
    assert parse_retry_after("2.5") == 2.5
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_aliases_do_not_shadow_the_builtins():
    assert iterserve_client.TimeoutError is APITimeoutError
    assert iterserve_client.ConnectionError is APIConnectionError
    assert issubclass(APITimeoutError, APIConnectionError)
    assert builtins.TimeoutError is not APITimeoutError
    assert all(issubclass(cls, APIError) for _, cls in CASES)
