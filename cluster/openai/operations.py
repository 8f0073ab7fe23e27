"""The operational routes: GET /health, /v1/stats and /metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from ..metrics.hub import CONTENT_TYPE
from .errors import RETRY_AFTER_UNAVAILABLE_S, APIError, error_body
from .gate import request_id
from .serving import OpenAIServing


def add_operations_routes(
    app: FastAPI, serving: OpenAIServing, metrics_body: Callable[[], Awaitable[bytes]]
) -> None:
    """``metrics_body`` renders GET /metrics (every engine replica's metrics in one
    exposition)."""

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
            error_body(503, message, None, "engine_unhealthy", request_id(request)),
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


_SUMMED_STATS = (
    "num_running", "num_waiting", "num_preempted", "slots_used", "slots_total",
    "kv_blocks_used", "kv_blocks_total", "num_preemptions",
)  # fmt: skip


def _ratio(used: int, total: int) -> float:
    return used / total if total else 0.0


def aggregate_stats(replicas: list[dict], model: str) -> dict:
    """The engine replicas' stats summed into one view, each replica's kept too."""
    total = {key: sum(r.get(key, 0) for r in replicas) for key in _SUMMED_STATS}
    # A replica still loading has no policy yet (nor any other figure).
    policies = sorted({r["policy"] for r in replicas if r.get("policy")})
    return {
        "object": "engine.stats",
        "model": model,
        "num_engine_replicas": len(replicas),
        "policy": policies[0] if len(policies) == 1 else policies or None,
        **total,
        "slot_utilization": _ratio(total["slots_used"], total["slots_total"]),
        "kv_usage": _ratio(total["kv_blocks_used"], total["kv_blocks_total"]),
        "healthy": all(r.get("healthy", False) for r in replicas),
        "tenants": _tenants(replicas),
        "replicas": replicas,
    }


def _tenants(replicas: list[dict]) -> dict[str, dict]:
    """Each tenant's figures summed over the replicas (``served``, a fair policy's
    counter of weighted tokens, is each replica's own: not summed, the largest kept)."""
    tenants: dict[str, dict] = {}
    for replica in replicas:
        for name, figures in replica.get("tenants", {}).items():
            total = tenants.setdefault(name, {})
            for key, value in figures.items():
                if key == "served":
                    total[key] = max(total.get(key, value), value)
                else:
                    total[key] = total.get(key, 0) + value
    return tenants
