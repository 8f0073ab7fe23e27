"""What an engine checks in a request from the wire before its scheduler sees it.

The ingress validated the request already; an engine checks again what only it
knows for sure (its vocabulary, its limits), so that a request from any other
consumer cannot put a bad value into a step.
"""

from __future__ import annotations

import time
from typing import Any

from ...scheduler import Request, SamplingParams, SchedulerConfig

MAX_LABEL_LEN = 256  # characters of a client's own name for a request (logs only)
MAX_REQUEST_ID_LEN = 256
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)


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
    if type(request_id) is not str or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id: must be a string of 1 to {MAX_REQUEST_ID_LEN} characters")
    if type(label) is not str or len(label) > MAX_LABEL_LEN:
        raise ValueError(f"label: must be a string of at most {MAX_LABEL_LEN} characters")
    low, high = PRIORITY_RANGE
    if type(priority) is not int or not low <= priority <= high:
        raise ValueError(f"priority: must be an integer in [{low}, {high}], got {priority!r}")
    if not isinstance(params, dict):
        raise TypeError(f"params: must be a mapping, got {type(params).__name__}")
    if not isinstance(prompt_token_ids, list):
        raise TypeError(f"prompt_token_ids: must be a list, got {type(prompt_token_ids).__name__}")
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
