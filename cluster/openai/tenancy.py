"""A request's tenant and first-token target, as the ingress reads them.

The tenant is whose turn a request takes under ``scheduling_policy: fair``
(and a label of the per-tenant metrics): the gateway's
``x-gateway-inference-fairness-id`` header (llm-d's flow control keys its
queues by it), else the OpenAI ``user`` field, else the one default tenant.
``x-slo-ttft-ms`` is the request's first-token target in milliseconds. Both
travel to the engine in the request's record (``EngineRequest``); neither is
the prefix cache's isolation key: tenants share cached prefixes.

A value that is not what it should be is refused with a 400 naming where it
came from; an empty one is as good as none.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from typing import Any

from ...scheduler.messages import DEFAULT_TENANT, MAX_SLO_TTFT_MS, MAX_TENANT_LEN
from .errors import bad_request

FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
SLO_HEADER = "x-slo-ttft-ms"
# The two headers' values for the request being served (set by the gate around it).
REQUEST_HEADERS: ContextVar[tuple[str | None, str | None]] = ContextVar(
    "iterserve_scheduling_headers", default=(None, None)
)


def headers_of(headers: dict[bytes, bytes]) -> tuple[str | None, str | None]:
    """The fairness id and the first-token target among a request's headers."""
    fairness, slo = headers.get(b"x-gateway-inference-fairness-id"), headers.get(b"x-slo-ttft-ms")
    return (
        None if fairness is None else fairness.decode("latin-1"),
        None if slo is None else slo.decode("latin-1"),
    )


def scheduling_fields(request: Any) -> dict[str, Any]:
    """What a request's engine jobs carry besides their sampling parameters:
    ``tenant`` (unless the default) and ``slo_ttft_ms`` (when set)."""
    fairness, slo = REQUEST_HEADERS.get()
    fields: dict[str, Any] = {}
    tenant = _tenant(fairness, FAIRNESS_HEADER) if fairness else None
    if tenant is None:
        user = getattr(request, "user", None)
        if user is not None and not isinstance(user, str):
            raise bad_request(f"user: must be a string, got {type(user).__name__}", "user")
        tenant = _tenant(user, "user") if user else None
    if tenant is not None and tenant != DEFAULT_TENANT:
        fields["tenant"] = tenant
    if slo:
        fields["slo_ttft_ms"] = _slo(slo)
    return fields


def _tenant(value: str, where: str) -> str:
    if len(value) > MAX_TENANT_LEN:
        raise bad_request(f"{where}: at most {MAX_TENANT_LEN} characters, got {len(value)}", where)
    return value


def _slo(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_SLO_TTFT_MS:  # NaN fails it too
        raise bad_request(
            f"{SLO_HEADER}: milliseconds in (0, {MAX_SLO_TTFT_MS:g}], got {text[:40]!r}",
            SLO_HEADER,
        )
    return value
