"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the Responses API over
the chat machinery.

A response is rendered and sampled as the chat request its items make
(:mod:`.items`): the model's chat template, the server's tool-call and
reasoning parsers, structured outputs for ``text.format`` and a constrained
``tool_choice``, one engine request. Its output is read into items and events
(:mod:`.output`); with ``store`` (the default) the finished response is kept
(:mod:`.store`), for GET and for ``previous_response_id``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, Response

from ..chat import render_prompt, tool_plan
from ..errors import APIError, bad_request
from ..generation import Generation
from ..jobs import build_jobs
from ..protocol import ChatCompletionRequest
from ..serving import GenerationStream, OpenAIServing, load_json
from ..stream import SSE_DONE, sse
from . import items as conversation
from .output import ResponseOutput, new_id, response_body, usage
from .protocol import ResponsesRequest, check_item_types
from .store import AsyncStore, LocalStore

# A chat request's names for what the Responses API calls otherwise: an error
# the chat machinery raises names the field the client sent.
_RENAMES = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def _renamed(exc: APIError) -> APIError:
    param, message = exc.param, exc.message
    for chat, ours in _RENAMES:
        if param is not None and (param == chat or param.startswith(chat + ".")):
            param = ours + param[len(chat) :]
            message = message.replace(chat, ours, 1)
            break
    if exc.code == "context_length_exceeded":
        message = message.replace("the messages", "the input")
    return APIError(exc.status, message, param=param, code=exc.code, headers=exc.headers)


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id[:128]}' not found (never stored, deleted, or "
        "dropped from the bounded store)",
        param=param,
        code="response_not_found",
    )


class ResponsesServing:
    """The Responses API over one :class:`OpenAIServing` (its engines, tokenizer and
    parsers) and a store of finished responses."""

    def __init__(self, serving: OpenAIServing, store: AsyncStore | None = None):
        self.serving = serving
        self.store = store if store is not None else LocalStore()

    async def _record(self, response_id: str, param: str | None = None) -> dict[str, Any]:
        record = await self.store.get(response_id)
        if record is None:
            raise not_found(response_id, param)
        return json.loads(record)

    async def retrieve(self, response_id: str) -> Response:
        return JSONResponse((await self._record(response_id))["response"])

    async def delete(self, response_id: str) -> Response:
        if not await self.store.delete(response_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def create(self, body: bytes, request_id: str) -> Response:
        self.serving.require_runner("generate", "/v1/responses")
        data = load_json(body)
        check_item_types(data)
        request, headers = await self.serving.parse_request(ResponsesRequest, data)
        if request.truncation == "auto":
            raise bad_request(
                "truncation: 'auto' is not supported; an input past the context is refused",
                "truncation",
            )
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = await self._record(request.previous_response_id, "previous_response_id")
            history = previous["items"] + previous["response"]["output"]
        own = conversation.own_items(request)
        try:
            turn = await self._prepare(request, history, own, request_id)
        except APIError as exc:
            raise _renamed(exc) from None
        generation = Generation(self.serving.engine, turn.jobs, self.serving.request_timeout_s)
        await generation.open()  # refusals raise here, before any byte is sent
        turn.stored_items = history + conversation.as_stored(own)
        if request.stream:
            return GenerationStream(
                generation,
                self._stream(generation, turn, request_id),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **headers},
            )
        try:
            async for _, delta in generation.deltas():
                turn.output.add(turn.read(delta))
        finally:
            generation.close()
        turn.output.finish(turn.complete)
        body = turn.body()
        await self._keep(turn, body)
        return JSONResponse(body, headers=headers)

    async def _prepare(self, request: ResponsesRequest, history, own, request_id: str) -> _Turn:
        serving = self.serving
        model = request.model or serving.model_name
        body = conversation.chat_body(request, conversation.from_stored(history), own, model)
        chat, _ = serving.validate(ChatCompletionRequest, body)
        tools = tool_plan(chat, serving.tool_call_parser)
        info = await serving.engine_info()
        text = render_prompt(serving.tokenizer, chat)
        prompt = await serving.encode(text, "input", chat.add_special_tokens)
        extensions = await serving.extensions(chat, info, tools.schema, prompt=text)
        skip = serving.skip_special_tokens(chat.skip_special_tokens, tools.parser)
        jobs = build_jobs(
            chat, [prompt], serving.tokenizer, serving.limits(info),
            logprobs=None, request_id=request_id, renames={}, skip_special_tokens=skip,
            extensions=extensions,
        )  # fmt: skip
        lora_name = serving.lora_name(request.model)
        if lora_name is not None:
            jobs[0].params["lora_name"] = lora_name
        return _Turn(
            request,
            jobs,
            serving.chat_text(chat, tools.parser, text),
            model=lora_name or serving.model_name,
            prompt_tokens=len(prompt),
            tool_choice=_tool_choice(request),
        )

    async def _stream(self, generation: Generation, turn: _Turn, request_id: str):
        output = turn.output
        try:
            snapshot = turn.body("in_progress")
            yield _events(
                [
                    output.event("response.created", response=snapshot),
                    output.event("response.in_progress", response=snapshot),
                ]
            )
            async for _, delta in generation.deltas():
                events = output.add(turn.read(delta))
                if events:
                    yield _events(events)
            events = output.finish(turn.complete)
            body = turn.body()
            kind = "response.completed" if turn.complete else "response.incomplete"
            events.append(output.event(kind, response=body))
            yield _events(events)
            await self._keep(turn, body)
        except APIError as exc:  # headers are sent: the error travels as an event
            error = output.event("error", code=exc.code, message=exc.message, param=exc.param)
            yield sse(error, event="error")
        finally:
            generation.close()
        yield SSE_DONE

    async def _keep(self, turn: _Turn, body: dict[str, Any]) -> None:
        if turn.request.store:
            record = {"response": body, "items": turn.stored_items}
            await self.store.put(body["id"], json.dumps(record, ensure_ascii=False).encode())


def _events(events: list[dict[str, Any]]) -> bytes:
    return b"".join(sse(event, event=event["type"]) for event in events)


def _tool_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


class _Turn:
    """One response in the making: its engine job, how its text is read, its output."""

    def __init__(self, request, jobs, text, *, model: str, prompt_tokens: int, tool_choice):
        self.request = request
        self.jobs = jobs
        self.text = text  # a ChatText
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.tool_choice = tool_choice
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.output = ResponseOutput()
        self.stored_items: list[dict[str, Any]] = []

    @property
    def choice(self):
        return self.jobs[0].choice

    @property
    def complete(self) -> bool:
        return self.choice.finish_reason != "length"

    def read(self, delta):
        if self.text.reasoning is not None:
            self.text.reasoning.count(delta.token_ids)
        return self.text.feed(delta.text, delta.finish_reason is not None)

    def body(self, status: str | None = None) -> dict[str, Any]:
        if status is None:
            status = "completed" if self.complete else "incomplete"
        counted = None
        if status != "in_progress":
            thought = self.text.reasoning
            counted = usage(
                self.prompt_tokens,
                self.choice.num_tokens,
                self.choice.num_cached_tokens,
                thought.num_reasoning_tokens if thought is not None else 0,
            )
        output = [] if status == "in_progress" else self.output.items
        return response_body(
            self.request, response_id=self.id, model=self.model, created_at=self.created_at,
            status=status, output=output, usage=counted, tool_choice=self.tool_choice,
        )  # fmt: skip


def add_responses_routes(app, serving: OpenAIServing, max_body_bytes: int) -> None:
    """POST /v1/responses, GET and DELETE /v1/responses/{response_id}."""
    from ..app import read_body, until_disconnect
    from ..gate import request_id

    responses = ResponsesServing(serving, serving.response_store)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        body = await read_body(request, max_body_bytes)
        return await until_disconnect(request, responses.create(body, request_id(request)))

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        return await responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Response:
        return await responses.delete(response_id)
