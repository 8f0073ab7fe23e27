"""What an engine checks in a request from the wire before its scheduler sees it.

The ingress validated the request already; an engine checks again what only it
knows for sure (its vocabulary, its limits), so that a request from any other
consumer cannot put a bad value into a step.
"""

from __future__ import annotations

import time
from typing import Any

from iterserve.scheduler import Request, SamplingParams, SchedulerConfig


def checked_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: dict[str, Any],
    *,
    priority: int,
    label: str,
    limits: SchedulerConfig,
    vocab_size: int,
) -> Request:
    """The scheduler's ``Request`` for these wire values; raises
    ``SamplingParamsError``, ``ValueError`` or ``TypeError`` naming what is wrong.
    ``params`` may name a LoRA adapter as ``lora_name``."""
    params = dict(params)
    lora_name = params.pop("lora_name", None)
    if lora_name is not None and (type(lora_name) is not str or not lora_name):
        raise ValueError(f"lora_name must be an adapter's name, got {lora_name!r}")
    sampling = SamplingParams(**params)
    sampling.check_limits(
        max_n=limits.max_n, max_logprobs=limits.max_logprobs, vocab_size=vocab_size
    )
    bad = [t for t in prompt_token_ids if type(t) is not int or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size - 1}], got {bad[0]!r}")
    return Request(
        request_id,
        list(prompt_token_ids),
        sampling,
        arrival_time=time.monotonic(),
        priority=priority,
        label=label,
        lora_name=lora_name,
    )
