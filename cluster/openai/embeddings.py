"""POST /v1/embeddings: a pooling runner's embeddings, in OpenAI's shape.

A server started with ``runner: pooling`` (``--runner pooling``) serves a decoder
checkpoint for embeddings. Each input is one engine request that computes its
prompt and nothing more (no token is sampled: ``max_tokens`` 0), scheduled like
any other prefill, pieces and all; the rank pools the prompt's final hidden
states (``pooling_type``: the last token's, or every token's mean) and hands the
vector back with the request's last output. Here it is cut to ``dimensions``
(the first ones, as Matryoshka embeddings are read), L2-normalised
(``pooling_normalize``, or the request's ``normalize``) and written as floats or
as base64 of little-endian float32s (``encoding_format``).
"""

from __future__ import annotations

import base64
import dataclasses
import math
import struct
import time
from typing import Any, ClassVar, Literal

from pydantic import Field
from starlette.responses import JSONResponse, Response

from ...scheduler.sampling import SamplingParams
from .errors import APIError, bad_request, unavailable
from .generation import Choice, Generation, Job
from .jobs import engine_id_prefix
from .protocol import PRIORITY_RANGE, Prompt, RequestModel

_IGNORED = "Accepted and ignored."


class EmbeddingRequest(RequestModel):
    """POST /v1/embeddings."""

    REFUSED: ClassVar[dict[str, str]] = {
        "truncate_prompt_tokens": "prompt truncation is not supported by this server",
    }

    model: str | None = Field(None, description="The served model name; unset: the base model.")
    input: Prompt = Field(
        description="A string, a list of strings, a list of token ids, or a list of such lists."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: little-endian float32 bytes."
    )
    dimensions: int | None = Field(
        None, description="Keep the first this many dimensions (before normalising)."
    )
    normalize: bool | None = Field(None, description="L2-normalise; unset: the server's setting.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's BOS to text inputs.")
    priority: int = Field(0, description="Scheduling priority: lower values are served first.")
    user: Any = Field(None, description=_IGNORED)
    truncate_prompt_tokens: Any = Field(None, description="Not supported: only null.")


def embedding_vector(pooled: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The pooled hidden state as the client gets it: cut, then L2-normalised."""
    vector = pooled[:dimensions] if dimensions is not None else pooled
    if not normalize:
        return list(vector)
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else list(vector)


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def create_embeddings(serving: Any, body: bytes | dict, request_id: str) -> Response:
    """The embeddings of a request's inputs (``serving``: the ingress's
    :class:`~.serving.OpenAIServing`, with ``runner: pooling``)."""
    serving.require_runner("pooling", "/v1/embeddings")
    request, headers = await serving.parse_request(EmbeddingRequest, body)
    lo, hi = PRIORITY_RANGE
    if not lo <= request.priority <= hi:
        raise bad_request(f"priority: must be in [{lo}, {hi}], got {request.priority}", "priority")
    info = await serving.engine_info()
    hidden_size = info.get("hidden_size")
    if request.dimensions is not None and not 1 <= request.dimensions <= (hidden_size or 1 << 30):
        raise bad_request(
            f"dimensions: must be in [1, {hidden_size}] (the model's hidden size), got "
            f"{request.dimensions}",
            "dimensions",
        )
    prompts = await serving.prompts(
        request.input, info["vocab_size"], request.add_special_tokens, field="input"
    )
    max_model_len = info["max_model_len"]
    for prompt in prompts:
        if len(prompt) >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"an input has {len(prompt)} tokens (at most {max_model_len - 1} are taken). "
                "Please reduce the length of the input.",
                param="input",
                code="context_length_exceeded",
            )
    params = dataclasses.asdict(SamplingParams(max_tokens=0))  # the prompt, nothing sampled
    prefix = engine_id_prefix(request_id)
    jobs = [
        Job(f"{prefix}-{i}", prompt, params, request.priority, Choice(i, None, (), False))
        for i, prompt in enumerate(prompts)
    ]
    lora_name = serving.lora_name(request.model)
    for job in jobs:
        if lora_name is not None:
            job.params["lora_name"] = lora_name
    generation = Generation(serving.engine, jobs, serving.request_timeout_s)
    await generation.open()
    try:
        async for _ in generation.deltas():
            pass
    finally:
        generation.close()
    normalize = serving.normalize_embeddings if request.normalize is None else request.normalize
    data = []
    for job in jobs:
        pooled = job.choice.pooled
        if pooled is None:
            raise unavailable("the engine finished an input without its embedding")
        vector = embedding_vector(pooled, request.dimensions, normalize)
        data.append(
            {
                "object": "embedding",
                "index": job.choice.index,
                "embedding": encode(vector, request.encoding_format),
            }
        )
    num_tokens = sum(map(len, prompts))
    answer = {
        "id": f"embd-{request_id}",
        "object": "list",
        "created": int(time.time()),
        "model": lora_name or serving.model_name,
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
    return JSONResponse(answer, headers=headers)


EMBEDDING_RULES = (
    "Rules across fields: each input holds fewer tokens than the context (400, code "
    "context_length_exceeded); dimensions is at most the model's hidden size. Served by a "
    "server started with runner: pooling only."
)


def embedding_constraints(completion: dict[str, dict], hidden_size: int | None) -> dict:
    """The value schema of EmbeddingRequest's checked fields (``completion``: the
    completions request's, whose prompt an input is)."""
    from .openapi_values import UNUSED, integer, nullable

    return {
        "input": completion["prompt"],
        "dimensions": nullable(integer(1, hidden_size or 1 << 20)),
        "priority": completion["priority"],
        "truncate_prompt_tokens": UNUSED,
    }
