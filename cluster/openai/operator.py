"""The operator's routes, at vLLM's paths: pause and resume generation, put the
engines to sleep and wake them (what RL and operations tools script against).

=====================================  =================================================
``POST /pause?mode=abort|wait|keep``   stop generating: end what runs (``abort``, the
                                       default), let it finish first (``wait``), or
                                       keep it to go on at resume (``keep``)
``POST /resume``                       generate again
``GET /is_paused``                     ``{"is_paused": bool}``
``POST /sleep?level=1|2&mode=...``     pause (``mode``, default ``abort``), then release
                                       the ranks' weights and KV cache
``POST /wake_up``                      re-acquire them (and resume a pause the sleep made)
``GET /is_sleeping``                   ``{"is_sleeping": bool}``
``POST /reset_prefix_cache``           forget every cached KV block (``reset_external=
                                       true``: the host and disk tiers' too;
                                       ``reset_running_requests=true``: preempt the
                                       running first); ``{"success": bool}``, false
                                       while requests hold blocks
=====================================  =================================================

Each call goes to every engine replica and answers once all have done it; every
route needs the API key. What an engine does is :mod:`~iterserve.cluster.engine.pause`'s.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from ..engine.pause import PAUSE_MODES, SLEEP_LEVELS, EngineStateError
from .errors import APIError, bad_request
from .serving import OpenAIServing

WAKE_TIMEOUT_S = 900.0  # a wake reloads the weights: as long as a start may take
WAKE_TAGS = ("weights", "kv_cache")  # vLLM's partial wakes: here both come back at once


def add_operator_routes(app: FastAPI, serving: OpenAIServing) -> None:
    wait_s = max(serving.request_timeout_s or 0.0, 120.0)  # a wait lasts its longest request

    @app.post("/pause")
    async def pause(request: Request) -> dict:
        mode = _choice(request, "mode", PAUSE_MODES)
        replicas = await _every_replica(serving, "pause", mode, timeout_s=wait_s)
        aborted = sum(r["aborted"] for r in replicas)
        return {"status": "paused", "mode": mode, "aborted": aborted, **_count(replicas)}

    @app.post("/resume")
    async def resume() -> dict:
        return {"status": "resumed", **_count(await _every_replica(serving, "resume"))}

    @app.get("/is_paused")
    async def is_paused() -> dict:
        replicas = await _every_replica(serving, "operator_state")
        return {"is_paused": all(r["paused"] for r in replicas), **_count(replicas)}

    @app.post("/sleep")
    async def sleep(request: Request) -> dict:
        level = int(_choice(request, "level", tuple(map(str, SLEEP_LEVELS)), default="1"))
        mode = _choice(request, "mode", PAUSE_MODES)
        replicas = await _every_replica(serving, "sleep", level, mode, timeout_s=wait_s)
        return {"status": "sleeping", "level": level, **_count(replicas)}

    @app.post("/wake_up")
    async def wake_up(request: Request) -> dict:
        for tag in request.query_params.getlist("tags"):
            if tag not in WAKE_TAGS:
                raise bad_request(f"tags: each must be one of {', '.join(WAKE_TAGS)}", "tags")
        replicas = await _every_replica(serving, "wake_up", timeout_s=WAKE_TIMEOUT_S)
        return {"status": "awake", **_count(replicas)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict:
        external = _flag(request, "reset_external")
        running = _flag(request, "reset_running_requests")
        replicas = await _every_replica(serving, "reset_prefix_cache", external, running)
        return {"success": all(r["success"] for r in replicas), **_count(replicas)}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        replicas = await _every_replica(serving, "operator_state")
        return {"is_sleeping": any(r["sleeping"] for r in replicas), **_count(replicas)}


def _choice(request: Request, name: str, choices: tuple[str, ...], default: str = "abort") -> str:
    value = request.query_params.get(name, default)
    if value not in choices:
        raise bad_request(f"{name}: must be one of {', '.join(choices)}, got {value!r}", name)
    return value


def _flag(request: Request, name: str) -> bool:
    """A boolean query parameter as FastAPI reads one (absent: false)."""
    value = request.query_params.get(name, "false").lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise bad_request(f"{name}: must be true or false, got {value!r}", name)


def _count(replicas: list[dict]) -> dict[str, Any]:
    return {"num_engine_replicas": len(replicas)}


async def _every_replica(serving: OpenAIServing, method: str, *args, timeout_s: float = 120.0):
    """Each engine replica's answer; a 409 when one's state refuses the call (resume
    while asleep), a 503 when one could not be reached or failed."""
    call_all = getattr(serving.engine, "call_all", None)
    if call_all is None:
        raise APIError(404, f"{method}: this server has no engine replicas to call")
    try:
        answers = await call_all(method, *args, timeout_s=timeout_s)
    except Exception as exc:  # no replica at all
        raise APIError(503, f"{method}: {exc}", code="engine_unavailable") from None
    for answer in answers:
        if isinstance(answer, BaseException):
            cause = getattr(answer, "cause", None) or answer
            if isinstance(cause, EngineStateError) or isinstance(answer, EngineStateError):
                raise APIError(409, str(cause).strip().splitlines()[-1], code="invalid_state")
            message = f"{method} failed on an engine replica: {type(cause).__name__}: {cause}"
            raise APIError(503, message, code="engine_unavailable")
    if not answers:
        raise APIError(503, f"{method}: no engine replica is running", code="engine_unavailable")
    return answers
