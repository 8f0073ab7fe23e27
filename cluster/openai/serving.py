"""The completions and chat handlers: validate, tokenize, fan out, answer.

Everything a client sends is checked here — JSON, fields, types, ranges,
context length, token ids — so a bad request is a 400 and never reaches the
scheduler. The engine sees only token ids and a checked ``SamplingParams``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import defaultdict
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine import RUNTIME_KEYS
from . import reasoning, structured
from .bodies import ChatText, Echo, ResponseBuilder
from .chat import render_prompt, tool_plan
from .errors import APIError, bad_request, unavailable
from .fields import (
    IGNORED_FIELDS_HEADER,
    FieldPolicy,
    check_refused,
    header_value,
)
from .generation import EngineClient, Generation
from .jobs import Limits, build_jobs, extension_fields
from .protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    RequestModel,
    validation_error,
)
from .stream import SSE_DONE, sse

_LONG_TEXT = 100_000  # characters; longer texts are tokenized off the event loop
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _json_number(text: str) -> int | float:
    """JSON has one number type: ``42.0`` is the integer 42 (as JSON Schema says),
    so integer fields take it; ``42.5`` stays a float and integer fields refuse it."""
    value = float(text)
    return int(value) if value.is_integer() else value


def load_json(body: bytes) -> dict:
    """A request body as a JSON object, or the 400 that says why it is not one."""
    try:
        data = json.loads(body, parse_float=_json_number)
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, absurd nesting
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


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
        strict_fields: bool = False,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        runner: str = "generate",
        normalize_embeddings: bool = True,
        settings: dict[str, Any] | None = None,
    ):
        self.engine = engine
        # What GET /version shows of how this server runs (policy, prefix caching, ...).
        self.settings = dict(settings or {})
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_n = max_n
        self.max_logprobs = max_logprobs
        self.request_timeout_s = request_timeout_s
        self.fields = FieldPolicy(strict_fields)
        self.tool_call_parser = tool_call_parser
        self.reasoning = reasoning.reasoning_parser(reasoning_parser, tokenizer)
        # What the engines run: "generate" (completions, chat, responses) or "pooling"
        # (embeddings, L2-normalised unless a request says otherwise).
        self.runner = runner
        self.normalize_embeddings = normalize_embeddings
        self.grammars = structured.GrammarValidator(getattr(tokenizer, "path", ""))
        self._info: dict | None = None
        # Other names of the base model (--served-model-name's after the first).
        self.model_aliases: tuple[str, ...] = ()
        # Sampling fields a request leaves unset take these (--generation-config).
        self.sampling_defaults: dict[str, Any] = {}
        # The LoRA adapters a request's model may name (cluster/lora.py); None: none.
        self.lora: Any = None
        # Where finished Responses API responses are kept (responses/store.py); None:
        # in this process.
        self.response_store: Any = None

    async def engine_info(self) -> dict:
        if self._info is None:
            try:
                self._info = await self.engine.info()
            except Exception as exc:  # no replica answered (still starting, or failed)
                raise unavailable(f"{type(exc).__name__}: {exc}") from None
        return self._info

    async def runtime(self) -> dict:
        """How the engine's ranks compute: the dtype and why, the CPU's instruction
        set and the kernel each op runs (``dtype``, ``dtype_reason``, ``isa``,
        ``kernels``), once an engine has answered; nothing while none has."""
        try:
            info = await self.engine_info()
        except APIError:
            return {}
        return {key: info[key] for key in RUNTIME_KEYS if key in info}

    # -- parsing ----------------------------------------------------------------------

    def parse(self, model_cls: type[RequestModel], body: bytes):
        return self.validate(model_cls, load_json(body))

    async def parse_request(self, model_cls: type[RequestModel], body: bytes | dict):
        """``parse``, asking the engines for their adapters once when ``model`` names
        one this ingress has not seen (loaded through another ingress, or at start)."""
        data = body if isinstance(body, dict) else load_json(body)
        try:
            return self.validate(model_cls, data)
        except APIError as exc:
            if exc.code != "model_not_found" or self.lora is None:
                raise
        await self.lora.refresh()
        return self.validate(model_cls, data)

    def lora_name(self, model: str | None) -> str | None:
        """The adapter a request's ``model`` names, or None for the base model."""
        return model if self.lora is not None and model in self.lora else None

    def validate(self, model_cls: type[RequestModel], data: dict):
        """The validated request and the headers its answer carries (the names it
        sent that this server ignored)."""
        try:
            request = model_cls.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        ignored = self.fields.ignored(request)
        self.check_model(request.model, required=model_cls.model_fields["model"].is_required())
        if hasattr(request, "REFUSED"):
            check_refused(request)
        if getattr(request, "stream_options", None) is not None and not request.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        headers = {IGNORED_FIELDS_HEADER: header_value(ignored)} if ignored else {}
        return request, headers

    def check_model(self, model: str | None, required: bool = True) -> None:
        if model is None and not required:
            return
        base = model == self.model_name or model in self.model_aliases
        if not base and self.lora_name(model) is None:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """A text as token ids; off the event loop when long."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"{param}: the text holds an unpaired surrogate", param) from None
        if len(text) > _LONG_TEXT:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    async def prompts(
        self, prompt: Any, vocab_size: int, add_special_tokens: bool = True, field: str = "prompt"
    ) -> list[list[int]]:
        """Token ids of each prompt of a completions ``prompt`` (or an embeddings
        ``input``, named by ``field``): a text, texts, token ids, lists of them."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request(f"{field}: must not be empty", field)
        if isinstance(prompt[0], int):
            prompt = [prompt]
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"{field}: at most {MAX_PROMPTS} prompts, got {len(prompt)}", field)
        prompts = []
        for item in prompt:
            if isinstance(item, str):
                ids = await self.encode(item, field, add_special_tokens)
            else:
                ids = list(item)
            if not ids:
                raise bad_request(f"{field}: must not be empty", field)
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise bad_request(
                    f"{field}: token ids must be in [0, {vocab_size - 1}], got {bad}", field
                )
            prompts.append(ids)
        return prompts

    async def chat_prompt(self, request) -> list[int]:
        """The prompt's token ids of a chat request (or a /tokenize of messages)."""
        text = render_prompt(self.tokenizer, request)
        return await self.encode(text, "messages", add_special_tokens=request.add_special_tokens)

    # -- endpoints --------------------------------------------------------------------

    def require_runner(self, runner: str, route: str) -> None:
        """404 for a route the engines' runner does not serve."""
        if self.runner != runner:
            served = "/v1/embeddings" if self.runner == "pooling" else (
                "/v1/completions, /v1/chat/completions and /v1/responses")  # fmt: skip
            raise APIError(
                404,
                f"{route} needs the {runner} runner; this server runs the {self.runner} runner "
                f"(runner: {self.runner}) and serves {served}",
                code="unsupported_endpoint",
            )

    async def embeddings(self, body: bytes | dict, request_id: str) -> Response:
        from .embeddings import create_embeddings

        return await create_embeddings(self, body, request_id)

    async def completions(self, body: bytes, request_id: str) -> Response:
        self.require_runner("generate", "/v1/completions")
        request, headers = await self.parse_request(CompletionRequest, body)
        if request.best_of not in (None, request.n):
            raise bad_request("best_of: only null or a value equal to n is supported", "best_of")
        info = await self.engine_info()
        prompts = await self.prompts(request.prompt, info["vocab_size"], request.add_special_tokens)
        extensions = await self.extensions(request, info)
        echoes = None
        if request.echo:  # the prompt's logprobs come with it when logprobs are asked for
            echoes = self._echoes(request, prompts)
            if request.logprobs is not None:
                asked = extensions.get("prompt_logprobs") or 0
                extensions["prompt_logprobs"] = max(asked, request.logprobs)
        jobs = build_jobs(
            request, prompts, self.tokenizer, self.limits(info),
            logprobs=request.logprobs, request_id=request_id, renames={},
            default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS, extensions=extensions,
            prompt_only=request.echo,
        )  # fmt: skip
        builder = self._builder(
            request, chat=False, request_id=request_id, prompts=prompts, echoes=echoes
        )
        return await self._respond(
            request, jobs, sum(map(len, prompts)), builder, request_id, headers
        )

    async def chat(self, body: bytes, request_id: str) -> Response:
        self.require_runner("generate", "/v1/chat/completions")
        request, headers = await self.parse_request(ChatCompletionRequest, body)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
        tools = tool_plan(request, self.tool_call_parser)
        info = await self.engine_info()
        text = render_prompt(self.tokenizer, request)
        prompt = await self.encode(text, "messages", request.add_special_tokens)
        extensions = await self.extensions(request, info, tools.schema, prompt=text)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        skip = self.skip_special_tokens(request.skip_special_tokens, tools.parser)
        jobs = build_jobs(
            request, [prompt], self.tokenizer, self.limits(info),
            logprobs=logprobs, request_id=request_id, renames={"logprobs": "top_logprobs"},
            skip_special_tokens=skip, extensions=extensions,
        )  # fmt: skip
        builder = self._builder(request, chat=True, request_id=request_id, prompts=[prompt])
        texts = {job.choice.index: self.chat_text(request, tools.parser, text) for job in jobs}
        return await self._respond(request, jobs, len(prompt), builder, request_id, headers, texts)

    def chat_text(self, request, tool_parser, prompt: str) -> ChatText:
        """How one choice's output is read: reasoning split off (with the server's
        reasoning parser), tool calls read out of the answer."""
        max_calls = 1 if request.parallel_tool_calls is False else None
        thought = self.reasoning.text(prompt) if self.reasoning is not None else None
        text = ChatText(tool_parser and tool_parser(), max_calls, thought)
        text.show_reasoning = getattr(request, "include_reasoning", True)
        return text

    def skip_special_tokens(self, requested: bool, tool_parser) -> bool:
        """Whether the text leaves special tokens out: not when a parser reads tags
        that this tokenizer counts as special."""
        tags = set(getattr(tool_parser, "tags", ()))
        if self.reasoning is not None:
            tags.update(reasoning.ReasoningText.tags)
        return requested and not tags & self.tokenizer.special_tokens

    async def extensions(
        self, request, info: dict, tool_schema: dict | None = None, prompt: str | None = None
    ) -> dict:
        """vLLM's engine-side fields as SamplingParams fields, and the grammar of
        structured outputs, once it is known to compile. ``prompt``: the text of a
        prompt whose output a reasoning parser reads; the grammar then constrains
        the answer only, after the reasoning block."""
        fields = extension_fields(request, self.tokenizer, info["vocab_size"])
        found = structured.requested(request, tool_schema)
        if found is not None:
            param, spec = found
            await self.grammars.check(param, spec, info["vocab_size"])
            if prompt is not None and self.reasoning is not None:
                spec = dataclasses.replace(spec, start_after=self.reasoning.grammar_start(prompt))
            fields["structured_output"] = spec
        return fields

    def _echoes(self, request, prompts: list[list[int]]) -> list[Echo]:
        """What each prompt's choices write first: a text prompt as it was sent,
        token ids as they decode."""
        sent = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if sent and isinstance(sent[0], int):
            sent = [sent]
        skip = request.skip_special_tokens
        return [
            Echo(
                p if isinstance(p, str) else self.tokenizer.decode(ids, skip), ids, request.logprobs
            )
            for p, ids in zip(sent, prompts)
        ]

    def limits(self, info: dict) -> Limits:
        return Limits(
            self.max_n, self.max_logprobs, info["max_model_len"], info["vocab_size"],
            self.sampling_defaults,
        )  # fmt: skip

    def _builder(
        self, request, *, chat: bool, request_id: str, prompts: list[list[int]], echoes=None
    ) -> ResponseBuilder:
        return ResponseBuilder(
            chat=chat,
            request_id=request_id,
            model=self.lora_name(request.model) or self.model_name,
            tokenizer=self.tokenizer,
            tokens_as_ids=request.return_tokens_as_token_ids,
            echoes=echoes,
            n=request.n,
            prompt_logprobs=request.prompt_logprobs is not None,
            prompt_ids=prompts,
        )

    async def _respond(
        self, request, jobs, prompt_tokens, builder, request_id, headers, texts=None
    ) -> Response:
        lora_name = self.lora_name(request.model)
        if lora_name is not None:
            for job in jobs:
                job.params["lora_name"] = lora_name
        generation = Generation(self.engine, jobs, self.request_timeout_s)
        await generation.open()  # refusals raise here, before any byte is sent
        if request.stream:
            options = request.stream_options
            builder.include_usage_field = bool(options and options.include_usage)
            builder.continuous_usage = bool(
                builder.include_usage_field and options.continuous_usage_stats
            )
            builder.prompt_tokens = prompt_tokens
            return GenerationStream(
                generation,
                self._stream(generation, builder, prompt_tokens, request_id, texts or {}),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **headers},
            )
        logprobs: dict[int, list] = defaultdict(list)
        try:
            async for choice, delta in generation.deltas():
                logprobs[choice.index].extend(delta.logprobs)
        finally:
            generation.close()
        choices = [job.choice for job in jobs]
        body = builder.response(choices, logprobs, prompt_tokens, (texts or {}).get)
        return JSONResponse(body, headers=headers)

    async def _stream(self, generation: Generation, builder, prompt_tokens, request_id, texts):
        try:
            async for choice, delta in generation.deltas():
                offset = len(choice.text) - len(delta.text)
                chunk = builder.chunk(choice, delta, offset, texts.get(choice.index))
                if chunk is not None:
                    yield sse(chunk)
            if builder.include_usage_field:
                choices = [job.choice for job in generation.jobs]
                yield sse(builder.usage_chunk(prompt_tokens, choices))
        except APIError as exc:  # headers are sent: the error travels as an event
            yield sse(exc.body(request_id))
        finally:
            # Runs when the client leaves too (the generator is cancelled or closed).
            generation.close()
        yield SSE_DONE


class GenerationStream(StreamingResponse):
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
