"""Typed errors: one class per kind of failure, chosen by the HTTP status.

Every error is an :class:`APIError`. The server answers errors in OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}``; the fields are
copied onto the exception, and the whole decoded body is kept in ``.body``.

    APIError
    ├── BadRequestError            400
    │   ├── PayloadTooLargeError   413
    │   └── UnprocessableEntityError 422
    ├── AuthenticationError        401
    ├── NotFoundError              404
    ├── RateLimitError             429   .retry_after
    ├── ServiceUnavailableError    503   .retry_after
    ├── InternalServerError        500, 502, 504 and any other 5xx
    └── APIConnectionError         no HTTP answer (refused, reset, cut mid-stream)
        └── APITimeoutError        the client's timeout ran out
"""

from __future__ import annotations

import email.utils
import time
from typing import Any


class APIError(Exception):
    """Base of every error the client raises.

    ``status_code`` is ``None`` when no HTTP answer arrived. ``request_id``
    comes from the ``X-Request-Id`` header or, failing that, the error body.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        request_id: str | None = None,
        body: Any = None,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.request_id = request_id
        self.body = body
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def __str__(self) -> str:
        parts = [f"{self.status_code}" if self.status_code is not None else None, self.message]
        if self.request_id:
            parts.append(f"(request_id={self.request_id})")
        return " ".join(p for p in parts if p)


class BadRequestError(APIError):
    """400: the request was refused as invalid; ``param`` names the field."""


class PayloadTooLargeError(BadRequestError):
    """413: the request body is larger than the server accepts."""


class UnprocessableEntityError(BadRequestError):
    """422: the body parsed but its content was refused."""


class AuthenticationError(APIError):
    """401: missing or wrong API key."""


class NotFoundError(APIError):
    """404: unknown path or model name."""


class RateLimitError(APIError):
    """429: the server is at capacity; ``retry_after`` says when to come back."""


class ServiceUnavailableError(APIError):
    """503: the engine is down or restarting; ``retry_after`` says when to come back."""


class InternalServerError(APIError):
    """5xx other than 503: the server failed while handling the request."""


class APIConnectionError(APIError):
    """No HTTP answer: connection refused or reset, or cut in the middle of a stream."""


class APITimeoutError(APIConnectionError):
    """The client's timeout ran out (connecting, or waiting for the next bytes)."""


# Module-level aliases; the client's own code uses only the API* names so the
# builtins of the same names are never shadowed there.
TimeoutError = APITimeoutError
ConnectionError = APIConnectionError

_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    413: PayloadTooLargeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}

# Errors that arrive inside a stream have no status of their own (the 200 was
# already sent); the OpenAI error type names the class instead.
_STATUS_BY_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "not_found_error": 404,
    "rate_limit_error": 429,
    "internal_error": 500,
    "service_unavailable_error": 503,
    "timeout_error": 504,
}


def error_class(status_code: int) -> type[APIError]:
    if status_code in _BY_STATUS:
        return _BY_STATUS[status_code]
    return InternalServerError if status_code >= 500 else APIError


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds from now: a number, or an HTTP date."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def make_error(
    status_code: int,
    body: Any,
    *,
    request_id: str | None = None,
    retry_after: str | None = None,
    fallback: str = "",
) -> APIError:
    """The typed error for an HTTP answer ``status_code`` with decoded ``body``."""
    detail = body.get("error") if isinstance(body, dict) else None
    if not isinstance(detail, dict):
        # Not OpenAI's shape (a proxy's page, FastAPI's {"detail": ...}): keep its text.
        message = body.get("detail") if isinstance(body, dict) else None
        detail = {"message": str(message) if message is not None else fallback}
    message = str(detail.get("message") or fallback or f"HTTP {status_code}")
    return error_class(status_code)(
        message,
        status_code=status_code,
        request_id=request_id or detail.get("request_id"),
        body=body,
        type=detail.get("type"),
        param=detail.get("param"),
        code=detail.get("code"),
        retry_after=parse_retry_after(retry_after),
    )


def stream_error(body: dict, request_id: str | None) -> APIError:
    """The typed error for an ``{"error": ...}`` event inside a stream."""
    detail = body.get("error") if isinstance(body.get("error"), dict) else {}
    status = _STATUS_BY_TYPE.get(str(detail.get("type")), 500)
    return make_error(status, body, request_id=request_id, fallback="error in stream")
