"""The FastAPI application: routes, auth, body limit, request ids, error mapping.

Request bodies are read and parsed by hand, not by FastAPI's body injection:
the size limit is enforced while reading, and validation errors become 400s in
OpenAI's error shape (a 422 never leaves this server).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from iterserve.cluster.metrics_hub import CONTENT_TYPE
from iterserve.cluster.openai.errors import (
    RETRY_AFTER_BUSY_S,
    RETRY_AFTER_UNAVAILABLE_S,
    APIError,
    error_body,
    error_response,
)
from iterserve.cluster.openai.fields import IGNORED_FIELDS_HEADER
from iterserve.cluster.openai.openapi import openapi_schema
from iterserve.cluster.openai.serving import OpenAIServing
from iterserve.cluster.openai.tokenize import detokenize, tokenize

MODEL_INFO_WAIT_S = 2.0  # how long /v1/models waits for the engines' context length
try:
    VERSION = importlib.metadata.version("iterserve")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    VERSION = "unknown"

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


# OpenAI endpoints clients probe that this server does not serve: a 404 that says so.
UNSUPPORTED_ENDPOINTS = {
    "/v1/responses": "the Responses API",
    "/v1/embeddings": "embeddings",
    "/v1/audio": "audio",
    "/v1/images": "images",
    "/v1/moderations": "moderations",
    "/v1/files": "files",
    "/v1/batches": "batches",
    "/v1/assistants": "assistants",
    "/v1/threads": "threads",
}


def _route_path(scope) -> str:
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

        path = _route_path(scope)
        open_paths = (
            ("/health",) if self.settings.metrics_require_api_key else ("/health", "/metrics")
        )
        bound = self.settings.max_ongoing_requests
        counted = path not in ("/health", "/metrics")
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


def check_content_type(request: Request) -> None:
    """Bodies are JSON: a request that says it sends anything else is refused (415).
    Without a Content-Type header the body is read as JSON."""
    content_type = request.headers.get("content-type")
    if content_type is None:
        return
    if content_type.partition(";")[0].strip().lower() != "application/json":
        raise APIError(
            415,
            f"Content-Type must be application/json, got {content_type[:64]!r}",
            code="unsupported_media_type",
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit``."""
    check_content_type(request)
    too_large = APIError(
        413, f"the request body exceeds max_body_bytes={limit} bytes", code="body_too_large"
    )
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, "the Content-Length header is not a number")
        if int(length) > limit:
            raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Runs ``work``, cancelling it (and so aborting its engine requests) when the
    client hangs up first: a whole response is only sent at the end, so nothing
    else would notice. A streamed response watches for that itself."""
    task = asyncio.ensure_future(work)

    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()


def _request_id(request: Request) -> str:
    return request.scope.get(REQUEST_ID_KEY, "")


def build_api(
    serving: OpenAIServing,
    settings: APISettings,
    metrics_body: Callable[[], Awaitable[bytes]],
) -> FastAPI:
    """The whole HTTP API over one :class:`OpenAIServing`; ``metrics_body`` renders
    GET /metrics (every engine replica's metrics in one exposition)."""
    # FastAPI's own schema knows nothing of the hand-parsed bodies; /openapi.json is
    # openapi.py's. No slash redirects: a path is a route or a 404.
    app = FastAPI(
        title="iterserve", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False
    )
    created = int(time.time())
    schema_cache: list[dict] = []

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, settings.max_body_bytes)
        return await until_disconnect(request, serving.completions(body, _request_id(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, settings.max_body_bytes)
        return await until_disconnect(request, serving.chat(body, _request_id(request)))

    @app.post("/tokenize")
    async def tokenize_text(request: Request) -> Response:
        return await tokenize(serving, await read_body(request, settings.max_body_bytes))

    @app.post("/detokenize")
    async def detokenize_ids(request: Request) -> Response:
        return await detokenize(serving, await read_body(request, settings.max_body_bytes))

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    async def unsupported(request: Request) -> Response:
        path = _route_path(request.scope)
        what = next(v for k, v in UNSUPPORTED_ENDPOINTS.items() if path.startswith(k))
        raise APIError(
            404,
            f"{what} ({request.method} {path}) is not supported by this server; it serves "
            "/v1/chat/completions and /v1/completions",
            code="unsupported_endpoint",
        )

    for prefix in UNSUPPORTED_ENDPOINTS:
        for path in (prefix, prefix + "/{rest:path}"):
            app.add_api_route(path, unsupported, methods=["GET", "POST", "DELETE"])

    async def model_card() -> dict:
        card = {"id": serving.model_name, "object": "model", "created": created}
        card["owned_by"] = "iterserve"
        if serving._info is None:
            # Asked of the engines once; a replica still loading must not hold the
            # listing up, which then goes out without the context length.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(serving.engine_info(), MODEL_INFO_WAIT_S)
        if serving._info is not None:
            card["max_model_len"] = serving._info["max_model_len"]
        return card

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [await model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != serving.model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", code="model_not_found")
        return await model_card()

    @app.get("/openapi.json")
    async def openapi() -> dict:
        if not schema_cache:
            info = await serving.engine_info()
            schema_cache.append(
                openapi_schema(
                    model_name=serving.model_name,
                    max_model_len=info["max_model_len"],
                    vocab_size=info["vocab_size"],
                    max_n=serving.max_n,
                    max_logprobs=serving.max_logprobs,
                    tool_call_parser=serving.tool_call_parser,
                    strict_fields=serving.fields.strict,
                )
            )
        return schema_cache[0]

    @app.get("/health")
    async def health(request: Request) -> Response:
        try:
            replicas = await serving.engine.health()
        except Exception as exc:  # no replica reachable
            replicas = [{"healthy": False, "message": f"{type(exc).__name__}: {exc}"}]
        sick = [r for r in replicas if not (r["healthy"] and r.get("ready", True))]
        if replicas and not sick:
            return JSONResponse({"status": "ok", "num_engine_replicas": len(replicas)})
        detail = "; ".join(r["message"] for r in sick) or "no engine replica is running"
        message = f"{len(sick) or 1} of {len(replicas) or 1} engine replicas not serving: {detail}"
        return JSONResponse(
            error_body(503, message, None, "engine_unhealthy", _request_id(request)),
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)},
        )

    async def replica_stats() -> list[dict]:
        try:
            return await serving.engine.stats()
        except Exception as exc:
            message = f"engine stats unavailable: {exc}"
            raise APIError(503, message, code="engine_unavailable") from None

    @app.get("/v1/stats")
    async def stats() -> dict:
        return aggregate_stats(await replica_stats(), serving.model_name)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            body = await metrics_body()
        except Exception as exc:
            raise APIError(503, f"metrics unavailable: {exc}", code="engine_unavailable") from None
        return Response(body, media_type=CONTENT_TYPE)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc, _request_id(request))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()))
        error = APIError(400, f"{param}: {first.get('msg')}", param=param or None)
        return error_response(error, _request_id(request))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        messages = {
            404: f"no route {request.url.path}",
            405: f"method {request.method} is not allowed on {request.url.path}",
        }
        message = messages.get(exc.status_code, str(exc.detail))
        error = APIError(exc.status_code, message, headers=dict(exc.headers or {}))
        return error_response(error, _request_id(request))

    app.add_middleware(Gate, settings=settings)
    if settings.cors_allowed_origins:
        # Outside the gate: a browser's preflight carries no credentials, so it is
        # answered before the API key is checked.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_allowed_origins),
            allow_credentials=settings.cors_allow_credentials,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["x-request-id", IGNORED_FIELDS_HEADER, "retry-after"],
            max_age=600,
        )
    return app


_SUMMED_STATS = (
    "num_running", "num_waiting", "num_preempted", "slots_used", "slots_total",
    "kv_blocks_used", "kv_blocks_total", "num_preemptions",
)  # fmt: skip


def _ratio(used: int, total: int) -> float:
    return used / total if total else 0.0


def aggregate_stats(replicas: list[dict], model: str) -> dict:
    """The engine replicas' stats summed into one view, each replica's kept too."""
    total = {key: sum(r.get(key, 0) for r in replicas) for key in _SUMMED_STATS}
    policies = sorted({r.get("policy") for r in replicas})
    return {
        "object": "engine.stats",
        "model": model,
        "num_engine_replicas": len(replicas),
        "policy": policies[0] if len(policies) == 1 else policies,
        **total,
        "slot_utilization": _ratio(total["slots_used"], total["slots_total"]),
        "kv_usage": _ratio(total["kv_blocks_used"], total["kv_blocks_total"]),
        "healthy": all(r.get("healthy", False) for r in replicas),
        "replicas": replicas,
    }
