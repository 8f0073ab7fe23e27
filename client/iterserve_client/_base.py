"""What the sync and async clients share: retry policy, request bodies, answers to errors.

Retrying is safe only when the server never started the request: the
connection could not be made, or the server refused it with 429 (queue full)
or 503 (engine unavailable) before queueing it. A completion is not
idempotent — a retried request that had started would sample again — so no
other failure is retried, and a stream is never retried once its response
has begun.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import httpx

from iterserve_client._version import __version__
from iterserve_client.errors import APIConnectionError, APIError, APITimeoutError, make_error

RETRY_STATUSES = frozenset({429, 503})


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter.

    Attempt ``k`` (0-based) waits a uniform random time in
    ``[0, min(backoff_max, backoff_base * 2**k)]``; a ``Retry-After`` from the
    server is waited instead, capped at ``backoff_max``.
    """

    max_retries: int = 2
    backoff_base: float = 0.5
    backoff_max: float = 8.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_base < 0 or self.backoff_max < 0:
            raise ValueError("backoff_base and backoff_max must be >= 0")

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return min(retry_after, self.backoff_max)
        return random.uniform(0.0, min(self.backoff_max, self.backoff_base * 2**attempt))

    def next_delay(self, attempt: int, failure: Exception) -> float | None:
        """Seconds to wait before retrying after ``failure`` (an ``httpx.TransportError``
        or a status ``APIError``) on attempt ``attempt``; ``None``: do not retry."""
        if attempt >= self.max_retries:
            return None
        if isinstance(failure, httpx.TransportError):
            return self.delay(attempt) if is_retryable_transport(failure) else None
        if isinstance(failure, APIError) and failure.status_code in RETRY_STATUSES:
            return self.delay(attempt, failure.retry_after)
        return None


def server_root(base_url: str) -> str:
    """The server's root URL: ``/health`` lives there, the API under ``/v1``.
    An OpenAI-style base URL ending in ``/v1`` is accepted too."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def default_headers(api_key: str | None, extra: dict[str, str] | None) -> dict[str, str]:
    headers = {"User-Agent": f"iterserve-client/{__version__}", "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    headers.update(extra or {})
    return headers


def make_timeout(timeout: float | httpx.Timeout | None) -> httpx.Timeout:
    if isinstance(timeout, httpx.Timeout):
        return timeout
    return httpx.Timeout(timeout)


def request_body(params: dict[str, Any]) -> dict[str, Any]:
    """The JSON body from a ``create`` method's ``locals()``: only what the caller gave.

    ``None`` means "not given" and is left out, as is ``stream=False``, so the
    server's defaults apply; ``extra`` keyword arguments are sent as they are.
    """
    params = dict(params)
    params.pop("self", None)
    extra = params.pop("extra", None) or {}
    body = {k: v for k, v in params.items() if v is not None}
    if body.get("stream") is False:
        del body["stream"]
    if "messages" in body:
        body["messages"] = [m.to_dict() if hasattr(m, "to_dict") else m for m in body["messages"]]
    body.update(extra)
    return body


def is_retryable_transport(exc: httpx.TransportError) -> bool:
    """The connection was never made, so the request never reached the server."""
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


def transport_error(exc: httpx.TransportError, url: str) -> APIError:
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"request to {url} timed out: {type(exc).__name__}: {exc}")
    return APIConnectionError(f"cannot reach {url}: {type(exc).__name__}: {exc}")


def decode_json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def status_error(response: httpx.Response) -> APIError:
    """The typed error for a non-2xx answer whose body has been read."""
    return make_error(
        response.status_code,
        decode_json(response),
        request_id=response.headers.get("x-request-id"),
        retry_after=response.headers.get("retry-after"),
        fallback=response.text[:500] if response.text else response.reason_phrase,
    )


def json_body(response: httpx.Response) -> Any:
    """The decoded body of a successful answer."""
    body = decode_json(response)
    if body is None:
        raise APIError(
            f"the server answered {response.status_code} with a body that is not JSON",
            status_code=response.status_code,
            request_id=response.headers.get("x-request-id"),
            body=response.text[:500],
        )
    return body


def health_message(response: httpx.Response) -> str:
    body = decode_json(response)
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "status", "detail"):
            if body.get(key):
                return str(body[key])
    return response.text.strip()[:500]
