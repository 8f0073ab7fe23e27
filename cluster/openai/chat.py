"""A chat request's prompt and tool plan: what the template renders, how the output is read.

The messages, the tools and the template options go to the model's own chat
template, as Hugging Face's ``apply_chat_template`` passes them (``tools``,
``documents``, extra variables); an assistant's earlier tool calls reach it with
their arguments as objects, which is what tool-calling templates expect.
``tool_choice`` decides how the output is read: ``none``, plain text; ``auto``,
through the server's tool-call parser; ``required`` and a named function
constrain it, with structured outputs, to calls that follow the tools' schemas.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import bad_request
from .protocol import ChatCompletionRequest, ChatMessage
from .tool_parsers import (
    TOOL_CALL_PARSERS,
    JsonArrayParser,
    NamedParser,
    ToolCallParser,
)

logger = logging.getLogger(__name__)

# Variables the server sets itself, and the template environment's own names: a
# chat_template_kwargs entry may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
        "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now",
        "range", "dict", "lipsum", "cycler", "joiner", "namespace",
    }
)  # fmt: skip
_warned_templates: set[int] = set()


def _content_text(message: ChatMessage, where: str) -> str:
    if isinstance(message.content, list):
        texts = []
        for k, part in enumerate(message.content):
            if part.type != "text" or part.text is None:
                param = f"{where}.content.{k}"
                kind = "a text part without text" if part.type == "text" else f"{part.type!r}"
                raise bad_request(f"{param}: only text parts are supported, got {kind}", param)
            texts.append(part.text)
        return "\n".join(texts)
    return message.content or ""


def _template_tool_calls(message: ChatMessage, where: str) -> list[dict[str, Any]]:
    calls = []
    for k, call in enumerate(message.tool_calls or []):
        arguments = call.function.arguments
        if isinstance(arguments, str):
            param = f"{where}.tool_calls.{k}.function.arguments"
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                raise bad_request(f"{param}: not valid JSON: {exc}", param) from None
            if not isinstance(arguments, dict):
                raise bad_request(f"{param}: must be a JSON object", param)
        entry = {
            "type": "function",
            "function": {"name": call.function.name, "arguments": arguments},
        }
        if call.id is not None:
            entry["id"] = call.id
        calls.append(entry)
    return calls


def template_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (text joined, arguments as objects)."""
    if not request.messages:
        raise bad_request("messages: must not be empty", "messages")
    messages = []
    for i, message in enumerate(request.messages):
        where = f"messages.{i}"
        if message.content is None and not message.tool_calls:
            param = f"{where}.content"
            raise bad_request(
                f"{param}: required (only an assistant's tool calls may go without)", param
            )
        entry: dict[str, Any] = {"role": message.role, "content": _content_text(message, where)}
        if message.tool_calls:
            entry["tool_calls"] = _template_tool_calls(message, where)
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(message, name) is not None:
                entry[name] = getattr(message, name)
        messages.append(entry)
    return messages


def template_options(request: ChatCompletionRequest) -> dict[str, Any]:
    """Keyword arguments of ``Tokenizer.apply_chat_template`` besides the messages."""
    extra = dict(request.chat_template_kwargs or {})
    reserved = sorted(set(extra) & RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        param = f"chat_template_kwargs.{reserved[0]}"
        raise bad_request(f"{param}: set by the server; use the request's own field", param)
    if request.continue_final_message and request.add_generation_prompt:
        raise bad_request(
            "continue_final_message: cannot be combined with add_generation_prompt: true "
            "(the model continues the last message, it does not start a new one)",
            "continue_final_message",
        )
    if request.reasoning_effort is not None:
        extra.setdefault("reasoning_effort", request.reasoning_effort)
    add_generation_prompt = request.add_generation_prompt
    if add_generation_prompt is None:
        add_generation_prompt = not request.continue_final_message
    return dict(
        extra,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=request.continue_final_message,
        tools=[tool.model_dump(by_alias=True, exclude_none=True) for tool in request.tools]
        if request.tools
        else None,
        documents=request.documents,
    )


def render_prompt(tokenizer: Any, request: ChatCompletionRequest) -> str:
    """The prompt text of a chat request; a template failure is the request's 400."""
    if tokenizer.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    messages = template_messages(request)
    options = template_options(request)
    if options["tools"] and "tools" not in tokenizer.chat_template:
        if id(tokenizer) not in _warned_templates:
            _warned_templates.add(id(tokenizer))
            logger.warning("tools were sent, but this model's chat template never shows them")
    try:
        return tokenizer.apply_chat_template(messages, **options)
    except Exception as exc:  # the template refused these messages (raise_exception, ...)
        raise bad_request(f"messages: {exc}", "messages") from None


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's output is read for tool calls (``parser``, None: as
    plain text), and the JSON schema it is constrained to (``schema``, None: free)."""

    parser: Callable[[], ToolCallParser] | None = None
    schema: dict[str, Any] | None = None


def _parameters(tool) -> dict[str, Any]:
    # A function without parameters takes an empty object.
    return tool.function.parameters or {"type": "object", "properties": {}}


def required_schema(tools, at_most_one: bool) -> dict[str, Any]:
    """``tool_choice: required``: a JSON list of one or more ``{"name", "parameters"}``
    calls, each naming one of the tools and holding its parameters (vLLM's shape)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if at_most_one:
        schema["maxItems"] = 1
    return schema


def tool_plan(request: ChatCompletionRequest, server_parser: str | None) -> ToolPlan:
    """How each choice's output is read, and constrained, for tool calls.

    ``tool_choice`` defaults to "auto" when tools are sent, as OpenAI's does.
    ``required`` and a named function constrain the output with structured
    outputs, so it always is a call that follows the tool's schema.
    """
    choice = request.tool_choice
    tools = request.tools or []
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan()
    if not tools:
        raise bad_request("tool_choice: needs tools", "tool_choice")
    if choice == "auto":
        if server_parser is None:
            raise bad_request(
                "tool_choice: 'auto' needs a tool-call parser; start the server with "
                f"--tool-call-parser ({' or '.join(TOOL_CALL_PARSERS)}), or send "
                'tool_choice: "none", "required" or a named function',
                "tool_choice",
            )
        return ToolPlan(TOOL_CALL_PARSERS[server_parser])
    if choice == "required":
        return ToolPlan(
            JsonArrayParser, required_schema(tools, request.parallel_tool_calls is False)
        )
    name = choice.function.name
    tool = next((tool for tool in tools if tool.function.name == name), None)
    if tool is None:
        raise bad_request(
            f"tool_choice: names {name!r}, which is not among the tools", "tool_choice"
        )
    return ToolPlan(lambda: NamedParser(name), _parameters(tool))
