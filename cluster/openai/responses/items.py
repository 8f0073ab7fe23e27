"""From a Responses request to the chat request it is rendered as.

The conversation is its items in order: those of the previous response (its
input items, then its output items, stored with it), then this request's
input; ``instructions`` go first, as a system message, and are not carried
to later responses. Items become the chat messages a chat template reads:

======================  =======================================================
item                    message
======================  =======================================================
message                 ``{role, content}`` (``developer`` as ``system``)
function_call           a ``tool_calls`` entry of the assistant message it
                        follows (or of a new one)
function_call_output    ``{"role": "tool", "tool_call_id", "content"}``
reasoning               ``reasoning_content`` of the next assistant message
======================  =======================================================

Tools, ``tool_choice``, ``text.format`` and the sampling fields become their
chat equivalents, so tool calls and structured outputs work as in chat.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import TypeAdapter

from ..errors import bad_request
from .protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)

# Fields passed to the chat request as they are, when set.
_CHAT_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "priority", "parallel_tool_calls",
    "chat_template_kwargs",
)  # fmt: skip


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class Messages:
    """Chat messages built from items, in order (``add``), then ``messages``."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._reasoning: str | None = None  # waiting for the assistant message it belongs to
        self._assistant: dict[str, Any] | None = None  # open to this turn's tool calls

    def add(self, item, param: str) -> None:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            message = {"role": role, "content": _text(item.content)}
            self._append(message, assistant=role == "assistant")
        elif isinstance(item, FunctionCallItem):
            _check_arguments(item.arguments, f"{param}.arguments")
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if self._assistant is None:
                self._append({"role": "assistant", "content": None}, assistant=True)
            assert self._assistant is not None
            self._assistant.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            self._append(message, assistant=False)
        elif isinstance(item, ReasoningItem):
            if item.encrypted_content is not None:
                name = f"{param}.encrypted_content"
                raise bad_request(f"{name}: this server never encrypts reasoning", name)
            parts = item.content if item.content is not None else item.summary
            self._reasoning = "".join(part.text for part in parts)

    def _append(self, message: dict[str, Any], *, assistant: bool) -> None:
        if assistant and self._reasoning is not None:
            message["reasoning_content"] = self._reasoning
            self._reasoning = None
        self.messages.append(message)
        self._assistant = message if assistant else None


def _check_arguments(arguments: str, param: str) -> None:
    try:
        value = json.loads(arguments)
    except ValueError as exc:
        raise bad_request(f"{param}: not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param}: must be a JSON object", param)


_ITEMS = TypeAdapter(list[InputItem])


def own_items(request: ResponsesRequest) -> list:
    """This request's input as items: a text is one user message."""
    if isinstance(request.input, str):
        return [MessageItem(role="user", content=request.input)]
    if not request.input:
        raise bad_request("input: must not be empty", "input")
    return list(request.input)


def as_stored(items: list) -> list[dict[str, Any]]:
    """Items as a stored response keeps them (JSON), read back by :func:`from_stored`."""
    return [item.model_dump(by_alias=True, exclude_none=True) for item in items]


def from_stored(items: list[dict[str, Any]]) -> list:
    return _ITEMS.validate_python(items)


def chat_body(request: ResponsesRequest, history: list, own: list, model: str) -> dict[str, Any]:
    """The chat request (as a body, for ``ChatCompletionRequest``) that renders and
    samples this response: ``history``, the earlier items (a previous response's,
    checked when it was made), then ``own``, this request's."""
    built = Messages()
    if request.instructions is not None:
        built.messages.append({"role": "system", "content": request.instructions})
    for item in history:
        built.add(item, "previous_response_id")
    for i, item in enumerate(own):
        built.add(item, f"input.{i}")
    if not built.messages:
        raise bad_request(
            "input: holds no message to answer (a reasoning item goes with the answer it led to)",
            "input",
        )
    body: dict[str, Any] = {"model": model, "messages": built.messages}
    for name in _CHAT_FIELDS:
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    if request.tools:
        body["tools"] = [chat_tool(tool) for tool in request.tools]
    choice = request.tool_choice
    if isinstance(choice, str):
        body["tool_choice"] = choice
    elif choice is not None:
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    form = request.text.format if request.text is not None else None
    if form is not None and form.type != "text":
        body["response_format"] = response_format(form)
    if request.reasoning is not None and request.reasoning.effort is not None:
        body["reasoning_effort"] = request.reasoning.effort
    return body


def chat_tool(tool) -> dict[str, Any]:
    function = {"name": tool.name}
    for name in ("description", "parameters", "strict"):
        if getattr(tool, name) is not None:
            function[name] = getattr(tool, name)
    return {"type": "function", "function": function}


def response_format(form) -> dict[str, Any]:
    """``text.format`` as chat's ``response_format``."""
    if form.type == "json_object":
        return {"type": "json_object"}
    for name, value in (("name", form.name), ("schema", form.json_schema)):
        if value is None:
            param = f"text.format.{name}"
            raise bad_request(f"{param}: required when type is json_schema", param)
    schema = {"name": form.name, "schema": form.json_schema}
    if form.strict is not None:
        schema["strict"] = form.strict
    if form.description is not None:
        schema["description"] = form.description
    return {"type": "json_schema", "json_schema": schema}
