"""The gate every HTTP request passes first: its request id, the API key, the
bound on requests at once, a 500 for anything unexpected; and it keeps the
headers that name the request's tenant and first-token target for the
request's engine jobs (:mod:`.tenancy`)."""

from __future__ import annotations

import hmac
import logging
import uuid
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from .errors import RETRY_AFTER_BUSY_S, APIError, error_response
from .tenancy import REQUEST_HEADERS, headers_of

logger = logging.getLogger(__name__)

REQUEST_ID_KEY = "iterserve.request_id"


@dataclass(frozen=True)
class APISettings:
    """api_key: required as ``Authorization: Bearer <key>`` on every route but
    /health (and /metrics, unless ``metrics_require_api_key``); None leaves the API
    open. max_body_bytes: largest request body. add_request_id_header: off behind
    Serve, whose proxy adds X-Request-Id itself. cors_allowed_origins: origins a
    browser may call from (``*``: any); empty: no CORS headers at all.
    max_ongoing_requests: requests served at once; beyond it a 503 with Retry-After
    (``/health`` and ``/metrics`` are always answered); None: no bound."""

    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    add_request_id_header: bool = True
    metrics_require_api_key: bool = True
    cors_allowed_origins: tuple[str, ...] = ()
    cors_allow_credentials: bool = False
    max_ongoing_requests: int | None = None


def route_path(scope) -> str:
    # Under a Serve route prefix the path still carries the prefix (root_path).
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path


class Gate:
    """ASGI middleware around every request: takes the request id from
    ``X-Request-Id`` (Serve's proxy sets it: the client's own, or a fresh one) or
    makes one, and returns it in a header; checks the API key; turns an
    unexpected exception into a 500 naming the request id."""

    def __init__(self, app, settings: APISettings):
        self.app = app
        self.settings = settings
        self.ongoing = 0

    def _authorized(self, scope) -> bool:
        if self.settings.api_key is None:
            return True
        values = [v for k, v in scope.get("headers", []) if k == b"authorization"]
        if len(values) != 1:  # none, or several that proxies and this check may read apart
            return False
        scheme, _, token = values[0].decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.settings.api_key.encode()
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128]
        request_id = request_id or str(uuid.uuid4())
        scope[REQUEST_ID_KEY] = request_id
        status = [500, False]  # status code, response started

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[:] = [message["status"], True]
                if self.settings.add_request_id_header:
                    extra = (b"x-request-id", request_id.encode("latin-1"))
                    message = {**message, "headers": [*message.get("headers", []), extra]}
            await send(message)

        path = route_path(scope)
        open_paths = (
            ("/health",) if self.settings.metrics_require_api_key else ("/health", "/metrics")
        )
        bound = self.settings.max_ongoing_requests
        counted = path not in ("/health", "/metrics")
        scheduling = REQUEST_HEADERS.set(headers_of(headers))  # the tenant's, for its jobs
        try:
            if path not in open_paths and not self._authorized(scope):
                error = APIError(
                    401,
                    "missing or invalid API key: send Authorization: Bearer <key>",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error_response(error, request_id)(scope, receive, send_with_id)
            elif counted and bound is not None and self.ongoing >= bound:
                error = APIError(
                    503,
                    f"the server is at capacity ({bound} requests at once); retry later",
                    code="server_busy",
                    headers={"Retry-After": str(RETRY_AFTER_BUSY_S)},
                )
                await error_response(error, request_id)(scope, receive, send_with_id)
            else:
                self.ongoing += counted
                try:
                    await self.app(scope, receive, send_with_id)
                finally:
                    self.ongoing -= counted
        except ClientDisconnect:
            pass  # the client left while sending its body: nobody to answer
        except Exception:
            logger.exception("request %s failed", request_id)
            if not status[1]:
                error = APIError(500, "internal error; see the server log", code="internal_error")
                await error_response(error, request_id)(scope, receive, send_with_id)
        finally:
            REQUEST_HEADERS.reset(scheduling)


def request_id(request: Request) -> str:
    return request.scope.get(REQUEST_ID_KEY, "")
