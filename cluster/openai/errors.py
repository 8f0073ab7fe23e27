"""Errors in OpenAI's JSON shape, and the engine's refusals mapped to HTTP.

Every error body is ``{"error": {"message", "type", "param", "code",
"request_id"}}``; the status code carries the class of failure.
"""

from __future__ import annotations

import json

from starlette.responses import Response

from ..engine.errors import EngineBusyError, EngineRefusal, InvalidRequestError

# Seconds a client should wait before retrying when the engine is busy / down.
RETRY_AFTER_BUSY_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self, request_id: str | None) -> dict:
        return error_body(self.status, self.message, self.param, self.code, request_id)


class EngineFailure(Exception):
    """The engine failed a request after accepting it (its ranks were lost)."""


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    request_id: str | None = None,
) -> dict:
    error = {
        "message": message,
        "type": _TYPES.get(status, "invalid_request_error"),
        "param": param,
        "code": code,
    }
    if request_id is not None:
        error["request_id"] = request_id
    return {"error": error}


def error_response(error: APIError, request_id: str | None) -> Response:
    return Response(
        json.dumps(error.body(request_id)),
        status_code=error.status,
        headers=error.headers,
        media_type="application/json",
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_refusal(refusal: EngineRefusal) -> APIError:
    """The HTTP answer to an engine's refusal, by its kind."""
    if refusal.kind == "model_not_found":  # an adapter unloaded since the ingress checked
        return APIError(404, refusal.message, param="model", code="model_not_found")
    if isinstance(refusal, InvalidRequestError):  # prompt_too_long among them
        return APIError(400, refusal.message, code=refusal.kind)
    if isinstance(refusal, EngineBusyError):
        return APIError(
            429,
            f"the engine is at capacity: {refusal.message}; retry later",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_BUSY_S)},
        )
    return unavailable(refusal.message)


def unavailable(message: str) -> APIError:
    return APIError(
        503,
        f"the engine is unavailable: {message}",
        code="engine_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)},
    )


def timed_out(timeout_s: float) -> APIError:
    return APIError(
        504,
        f"the request did not finish within request_timeout_s={timeout_s:g} seconds; "
        "it was aborted",
        code="timeout",
    )
