"""What an engine checks in a request from the wire before its scheduler sees it.

The ingress validated the request already, and the codec checked every type of
its record; an engine checks again what only it knows for sure (its vocabulary,
its limits) and every bound, so that a request from any other consumer cannot
put a bad value into a step.
"""

from __future__ import annotations

import time

from ...scheduler import Request, SchedulerConfig
from ...scheduler.messages import MAX_SLO_TTFT_MS, MAX_TENANT_LEN, EngineRequest

MAX_LABEL_LEN = 256  # characters of a client's own name for a request (logs only)
MAX_REQUEST_ID_LEN = 256
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)


def checked_request(wire: EngineRequest, *, limits: SchedulerConfig, vocab_size: int) -> Request:
    """The scheduler's ``Request`` for this wire record; raises
    ``SamplingParamsError`` or ``ValueError`` naming what is wrong."""
    if not 0 < len(wire.request_id) <= MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id: must be a string of 1 to {MAX_REQUEST_ID_LEN} characters")
    if len(wire.label) > MAX_LABEL_LEN:
        raise ValueError(f"label: must be a string of at most {MAX_LABEL_LEN} characters")
    low, high = PRIORITY_RANGE
    if not low <= wire.priority <= high:
        raise ValueError(f"priority: must be an integer in [{low}, {high}], got {wire.priority!r}")
    if not 0 < len(wire.tenant) <= MAX_TENANT_LEN:
        raise ValueError(f"tenant: must be a string of 1 to {MAX_TENANT_LEN} characters")
    slo = wire.slo_ttft_ms
    if slo is not None and not 0 < slo <= MAX_SLO_TTFT_MS:
        raise ValueError(f"slo_ttft_ms: must be in (0, {MAX_SLO_TTFT_MS:g}], got {slo!r}")
    if wire.lora_name is not None and not wire.lora_name:
        raise ValueError(f"lora_name must be an adapter's name, got {wire.lora_name!r}")
    wire.params.check_limits(
        max_n=limits.max_n, max_logprobs=limits.max_logprobs, vocab_size=vocab_size
    )
    bad = [t for t in wire.prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size - 1}], got {bad[0]!r}")
    arrival = time.monotonic()
    return Request(
        wire.request_id,
        wire.prompt_token_ids,
        wire.params,
        arrival_time=arrival,
        priority=wire.priority,
        label=wire.label,
        lora_name=wire.lora_name,
        tenant=wire.tenant,
        ttft_deadline=None if slo is None else arrival + slo / 1000,
    )
