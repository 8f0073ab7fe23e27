"""The FastAPI application: its routes, the body limit and the error mapping
(the gate in front of it: gate.py; the operational routes: operations.py).

Request bodies are read and parsed by hand, not by FastAPI's body injection:
the size limit is enforced while reading, and validation errors become 400s in
OpenAI's error shape (a 422 never leaves this server).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from .errors import APIError, error_response
from .fields import IGNORED_FIELDS_HEADER
from .gate import APISettings, Gate, request_id, route_path
from .openapi import openapi_schema
from .operations import add_operations_routes
from .operator import add_operator_routes
from .responses import add_responses_routes
from .serving import OpenAIServing
from .tokenize import detokenize, tokenize

MODEL_INFO_WAIT_S = 2.0  # how long /v1/models waits for the engines' context length
try:
    VERSION = importlib.metadata.version("iterserve")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    VERSION = "unknown"


# OpenAI endpoints clients probe that this server does not serve: a 404 that says so.
UNSUPPORTED_ENDPOINTS = {
    "/v1/audio": "audio",
    "/v1/images": "images",
    "/v1/moderations": "moderations",
    "/v1/files": "files",
    "/v1/batches": "batches",
    "/v1/assistants": "assistants",
    "/v1/threads": "threads",
}


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
    add_generation_routes(app, serving, settings.max_body_bytes)
    add_responses_routes(app, serving, settings.max_body_bytes)
    add_model_routes(app, serving)
    add_operations_routes(app, serving, metrics_body)
    add_operator_routes(app, serving)
    if serving.lora is not None:
        from ..lora import add_lora_routes

        add_lora_routes(app, serving, settings.max_body_bytes)
    add_error_handlers(app)
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


def add_generation_routes(app: FastAPI, serving: OpenAIServing, max_body_bytes: int) -> None:
    """POST /v1/completions, /v1/chat/completions, /v1/embeddings, /tokenize and
    /detokenize."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, max_body_bytes)
        return await until_disconnect(request, serving.completions(body, request_id(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, max_body_bytes)
        return await until_disconnect(request, serving.chat(body, request_id(request)))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await read_body(request, max_body_bytes)
        return await until_disconnect(request, serving.embeddings(body, request_id(request)))

    @app.post("/tokenize")
    async def tokenize_text(request: Request) -> Response:
        return await tokenize(serving, await read_body(request, max_body_bytes))

    @app.post("/detokenize")
    async def detokenize_ids(request: Request) -> Response:
        return await detokenize(serving, await read_body(request, max_body_bytes))


def add_model_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """GET /v1/models, /v1/models/{id}, /openapi.json and /version, and a 404 naming
    what is missing for the OpenAI endpoints this server does not serve."""
    created = int(time.time())
    schema_cache: list[dict] = []

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION, **serving.settings, **await serving.runtime()}

    async def unsupported(request: Request) -> Response:
        path = route_path(request.scope)
        what = next(v for k, v in UNSUPPORTED_ENDPOINTS.items() if path.startswith(k))
        raise APIError(
            404,
            f"{what} ({request.method} {path}) is not supported by this server; it serves "
            "/v1/chat/completions, /v1/completions and /v1/responses",
            code="unsupported_endpoint",
        )

    for prefix in UNSUPPORTED_ENDPOINTS:
        for path in (prefix, prefix + "/{rest:path}"):
            app.add_api_route(path, unsupported, methods=["GET", "POST", "DELETE"])

    async def model_card(name: str | None = None) -> dict:
        card = {"id": name or serving.model_name, "object": "model", "created": created}
        card["owned_by"] = "iterserve"
        if serving._info is None:
            # Asked of the engines once; a replica still loading must not hold the
            # listing up, which then goes out without the context length.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(serving.engine_info(), MODEL_INFO_WAIT_S)
        if serving._info is not None:
            card["max_model_len"] = serving._info["max_model_len"]
        return card

    async def adapter_cards() -> list[dict]:
        if serving.lora is None:
            return []
        with contextlib.suppress(Exception):  # engines still loading: none listed yet
            await asyncio.wait_for(serving.lora.refresh(), MODEL_INFO_WAIT_S)
        return serving.lora.cards(created)

    @app.get("/v1/models")
    async def models() -> dict:
        names = [serving.model_name, *serving.model_aliases]
        cards = [await model_card(name) for name in names]
        return {"object": "list", "data": [*cards, *await adapter_cards()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id in serving.model_aliases:
            return await model_card(model_id)
        if model_id != serving.model_name:
            card = next((c for c in await adapter_cards() if c["id"] == model_id), None)
            if card is None:
                raise APIError(
                    404, f"The model '{model_id}' does not exist", code="model_not_found"
                )
            return card
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
                    runner=serving.runner,
                    hidden_size=info.get("hidden_size"),
                )
            )
        return schema_cache[0]


def add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's error shape, with the request id."""

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc, request_id(request))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()))
        error = APIError(400, f"{param}: {first.get('msg')}", param=param or None)
        return error_response(error, request_id(request))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        messages = {
            404: f"no route {request.url.path}",
            405: f"method {request.method} is not allowed on {request.url.path}",
        }
        message = messages.get(exc.status_code, str(exc.detail))
        error = APIError(exc.status_code, message, headers=dict(exc.headers or {}))
        return error_response(error, request_id(request))
