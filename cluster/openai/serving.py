"""The completions and chat handlers: validate, tokenize, fan out, answer.

Everything a client sends is checked here — JSON, fields, types, ranges,
context length, token ids — so a bad request is a 400 and never reaches the
scheduler. The engine sees only token ids and a checked ``SamplingParams``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import uuid
from collections import defaultdict
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from iterserve.cluster.openai.errors import APIError, bad_request, unavailable
from iterserve.cluster.openai.generation import Choice, EngineClient, Generation, Job
from iterserve.cluster.openai.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    StrictModel,
    validation_error,
)
from iterserve.cluster.openai.responses import ResponseBuilder
from iterserve.cluster.openai.stream import SSE_DONE, sse
from iterserve.scheduler.sampling import MAX_SEED, SamplingParams, SamplingParamsError

_LONG_TEXT = 100_000  # characters; longer texts are tokenized off the event loop
_PLAIN_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
# Request fields passed to SamplingParams as they are (when set).
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "seed",
)  # fmt: skip


def _json_number(text: str) -> int | float:
    """JSON has one number type: ``42.0`` is the integer 42 (as JSON Schema says),
    so integer fields take it; ``42.5`` stays a float and integer fields refuse it."""
    value = float(text)
    return int(value) if value.is_integer() else value


def engine_id_prefix(request_id: str) -> str:
    """Engine requests are named ``<request id>-<choice index>`` so logs and
    stats can be traced back; a request id that is not a short plain token is
    replaced rather than sent to the scheduler."""
    return request_id if _PLAIN_ID.fullmatch(request_id) else uuid.uuid4().hex


class OpenAIServing:
    """The API's behaviour, independent of how it is served."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        *,
        model_name: str,
        max_n: int,
        max_logprobs: int,
        request_timeout_s: float | None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_n = max_n
        self.max_logprobs = max_logprobs
        self.request_timeout_s = request_timeout_s
        self._info: dict | None = None

    async def engine_info(self) -> dict:
        if self._info is None:
            try:
                self._info = await self.engine.info()
            except Exception as exc:  # no replica answered (still starting, or failed)
                raise unavailable(f"{type(exc).__name__}: {exc}") from None
        return self._info

    # -- parsing ----------------------------------------------------------------------

    def parse(self, model_cls: type[StrictModel], body: bytes):
        try:
            data = json.loads(body, parse_float=_json_number)
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, absurd nesting
            raise bad_request(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            request = model_cls.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if request.model != self.model_name:
            raise APIError(
                404,
                f"The model '{request.model}' does not exist; this server serves "
                f"'{self.model_name}'",
                param="model",
                code="model_not_found",
            )
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        return request

    async def _encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"{param}: the text holds an unpaired surrogate", param) from None
        if len(text) > _LONG_TEXT:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    async def _completion_prompts(self, prompt: Any, vocab_size: int) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt: must not be empty", "prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts, got {len(prompt)}", "prompt")
        prompts = []
        for item in prompt:
            ids = await self._encode(item, "prompt") if isinstance(item, str) else list(item)
            if not ids:
                raise bad_request("prompt: must not be empty", "prompt")
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise bad_request(
                    f"prompt: token ids must be in [0, {vocab_size - 1}], got {bad}", "prompt"
                )
            prompts.append(ids)
        return prompts

    async def _chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        if not request.messages:
            raise bad_request("messages: must not be empty", "messages")
        if self.tokenizer.chat_template is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        messages = [m.as_template_input() for m in request.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as exc:  # the template rejected these messages (raise_exception, ...)
            raise bad_request(f"messages: {exc}", "messages") from None
        return await self._encode(text, "messages", add_special_tokens=False)

    # -- sampling parameters ----------------------------------------------------------

    def _params(
        self, request, max_tokens: int | None, prompt_len: int, info: dict, logprobs: int | None
    ) -> SamplingParams:
        max_model_len = info["max_model_len"]
        room = max_model_len - prompt_len
        if room < 1:  # the prompt alone fills the context: say so before any other field
            completion_len = max_tokens if max_tokens is not None and max_tokens >= 1 else 1
            raise _context_error(request, max_model_len, prompt_len, completion_len)
        # The configured caps first, so the message states the range that applies here.
        if request.n > self.max_n:
            raise SamplingParamsError("n", f"must be in [1, {self.max_n}], got {request.n}")
        if logprobs is not None and logprobs > self.max_logprobs:
            message = f"must be in [0, {self.max_logprobs}], got {logprobs}"
            raise SamplingParamsError("logprobs", message)
        fields = {
            name: getattr(request, name)
            for name in _SAMPLING_FIELDS
            if getattr(request, name) is not None
        }
        fields.update(
            n=request.n,
            max_tokens=max(room, 1) if max_tokens is None else max_tokens,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            stop_token_ids=tuple(request.stop_token_ids or ()),
        )
        params = SamplingParams(**fields)
        params.check_limits(
            max_n=self.max_n, max_logprobs=self.max_logprobs, vocab_size=info["vocab_size"]
        )
        if params.max_tokens > room:
            raise _context_error(request, max_model_len, prompt_len, params.max_tokens)
        return params

    def _jobs(self, request, prompts, max_tokens, info, logprobs, request_id, renames) -> list[Job]:
        stops = request.stop_strings()
        prefix = engine_id_prefix(request_id)
        jobs = []
        try:
            for p, prompt in enumerate(prompts):
                params = self._params(request, max_tokens, len(prompt), info, logprobs)
                for j in range(request.n):
                    # Choice j of every prompt uses seed + j: the same prompt and seed
                    # give the same choices alone or in a batch. It wraps past MAX_SEED,
                    # so every seed the API accepts works with every n.
                    seed = None if params.seed is None else (params.seed + j) % (MAX_SEED + 1)
                    one = dataclasses.asdict(dataclasses.replace(params, n=1, seed=seed))
                    index = p * request.n + j
                    choice = Choice(
                        index, self.tokenizer.detokenizer(prompt), stops, logprobs is not None
                    )
                    jobs.append(Job(f"{prefix}-{index}", prompt, one, request.priority, choice))
        except SamplingParamsError as exc:
            field = renames.get(exc.field, exc.field)
            message = str(exc).removeprefix(f"{exc.field}: ")
            raise bad_request(f"{field}: {message}", field) from None
        return jobs

    # -- endpoints --------------------------------------------------------------------

    async def completions(self, body: bytes, request_id: str) -> Response:
        request = self.parse(CompletionRequest, body)
        if request.best_of not in (None, request.n):
            raise bad_request("best_of: only null or a value equal to n is supported", "best_of")
        info = await self.engine_info()
        prompts = await self._completion_prompts(request.prompt, info["vocab_size"])
        jobs = self._jobs(
            request, prompts, request.max_tokens, info, request.logprobs, request_id, {}
        )
        builder = ResponseBuilder(
            chat=False, request_id=request_id, model=self.model_name, tokenizer=self.tokenizer
        )
        return await self._respond(request, jobs, sum(map(len, prompts)), builder, request_id)

    async def chat(self, body: bytes, request_id: str) -> Response:
        request = self.parse(ChatCompletionRequest, body)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
        max_tokens, renames = request.max_tokens, {"logprobs": "top_logprobs"}
        if request.max_completion_tokens is not None:
            max_tokens = request.max_completion_tokens
            renames["max_tokens"] = "max_completion_tokens"
        info = await self.engine_info()
        prompt = await self._chat_prompt(request)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        jobs = self._jobs(request, [prompt], max_tokens, info, logprobs, request_id, renames)
        builder = ResponseBuilder(
            chat=True, request_id=request_id, model=self.model_name, tokenizer=self.tokenizer
        )
        return await self._respond(request, jobs, len(prompt), builder, request_id)

    async def _respond(self, request, jobs, prompt_tokens, builder, request_id) -> Response:
        generation = Generation(self.engine, jobs, self.request_timeout_s)
        await generation.open()  # refusals raise here, before any byte is sent
        if request.stream:
            builder.include_usage_field = bool(
                request.stream_options and request.stream_options.include_usage
            )
            return _GenerationStream(
                generation,
                self._stream(generation, builder, prompt_tokens, request_id),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        logprobs: dict[int, list] = defaultdict(list)
        try:
            async for choice, delta in generation.deltas():
                logprobs[choice.index].extend(delta.logprobs)
        finally:
            generation.close()
        choices = [job.choice for job in jobs]
        return JSONResponse(builder.response(choices, logprobs, prompt_tokens))

    async def _stream(self, generation: Generation, builder, prompt_tokens, request_id):
        try:
            if builder.chat:
                for job in generation.jobs:
                    yield sse(builder.role_chunk(job.choice.index))
            async for choice, delta in generation.deltas():
                if delta.text or delta.finish_reason or delta.logprobs:
                    offset = len(choice.text) - len(delta.text)
                    yield sse(builder.chunk(choice, delta, offset))
            if builder.include_usage_field:
                completion_tokens = sum(job.choice.num_tokens for job in generation.jobs)
                yield sse(builder.usage_chunk(prompt_tokens, completion_tokens))
        except APIError as exc:  # headers are sent: the error travels as an event
            yield sse(exc.body(request_id))
        finally:
            # Runs when the client leaves too (the generator is cancelled or closed).
            generation.close()
        yield SSE_DONE


def _context_error(request, max_model_len: int, prompt_len: int, completion_len: int) -> APIError:
    where = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {prompt_len + completion_len} tokens ({prompt_len} in the {where}, "
        f"{completion_len} in the completion). Please reduce the length of the "
        f"{where} or completion.",
        param=where,
        code="context_length_exceeded",
    )


class _GenerationStream(StreamingResponse):
    """A stream that ends its engine requests however the response ends: a client
    gone before the first byte never starts the body generator, so the generator's
    own cleanup cannot be relied on alone."""

    def __init__(self, generation: Generation, content, **kwargs):
        super().__init__(content, **kwargs)
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()
