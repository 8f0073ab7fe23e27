"""POST /v1/responses bodies (Open Responses, as OpenAI's client sends them), as
pydantic models: strict values, unknown names ignored (and reported), fields
this server cannot honour refused by name (``REFUSED``), as the other endpoints'.

Input items are the conversation: messages (``user``, ``assistant``,
``system``, ``developer``), the model's earlier ``function_call`` items and
the ``function_call_output`` items that answer them, and ``reasoning`` items.
Their ``type`` picks the model (a message may leave it out); an item of any
other type is refused naming its index and type (:func:`check_item_types`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag

from ..errors import bad_request
from ..protocol import RequestModel

_IGNORED = "Accepted and ignored."
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
REFUSED_RESPONSES = {
    "background": "background responses are not supported by this server",
    "conversation": "conversations are not supported; chain responses with previous_response_id",
    "prompt": "stored prompt templates are not supported by this server",
    "include": "is not supported by this server (reasoning comes as reasoning items, in full)",
    "top_logprobs": "logprobs are not returned by this server's Responses API",
    "context_management": "is not supported by this server",
}


class TextPart(RequestModel):
    """A message's text: ``input_text``, or ``output_text`` in an earlier answer."""

    type: Literal["input_text", "output_text", "text"] = Field(
        description="Only text parts: input_text (output_text in an assistant's answer)."
    )
    text: str
    annotations: Any = Field(None, description=_IGNORED)
    logprobs: Any = Field(None, description=_IGNORED)


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"] = Field(
        description="developer is rendered as system."
    )
    content: str | list[TextPart] = Field(description="Text, or a list of text parts.")
    id: str | None = None
    status: Any = Field(None, description=_IGNORED)
    phase: Any = Field(None, description=_IGNORED)


class FunctionCallItem(RequestModel):
    """A call the model made (an earlier response's output item, passed back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="The arguments, as a JSON object text.")
    id: str | None = None
    status: Any = Field(None, description=_IGNORED)


class FunctionCallOutputItem(RequestModel):
    """The result of a call, for the model to read (a ``tool`` message)."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: Any = Field(None, description=_IGNORED)


class ReasoningPart(RequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(RequestModel):
    """An earlier answer's reasoning, passed back: given to the chat template with
    the assistant message that follows it (``reasoning_content``)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = Field(
        None, description="Not supported: this server never encrypts reasoning."
    )
    status: Any = Field(None, description=_IGNORED)


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(RequestModel):
    type: Literal["function"] = Field(description="Only function tools.")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description='"text"; "json_object": any JSON object; "json_schema": the output '
        "follows schema."
    )
    name: str | None = Field(None, description="The schema's name (json_schema: required).")
    json_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON schema (json_schema: required)."
    )
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Any = Field(None, description=_IGNORED)


class ReasoningConfig(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="Passed to the chat template as reasoning_effort."
    )
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="Accepted; reasoning items carry the reasoning itself, no summary."
    )
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description=_IGNORED
    )


class ResponsesRequest(RequestModel):
    """POST /v1/responses."""

    REFUSED: ClassVar[dict[str, str]] = REFUSED_RESPONSES

    model: str | None = Field(None, description="The served model name; unset: the base model.")
    input: str | list[InputItem] = Field(description="A user message's text, or input items.")
    instructions: str | None = Field(
        None, description="A system message before the input (not carried to later responses)."
    )
    previous_response_id: str | None = Field(
        None, description="Continue a stored response: its input and output come first."
    )
    store: bool = Field(True, description="Keep the response for GET and previous_response_id.")
    stream: bool = Field(False, description="Stream typed Server-Sent Events.")
    max_output_tokens: int | None = Field(
        None, description="Most tokens to generate, reasoning included; unset: the room left."
    )
    temperature: float | None = Field(None, description="In [0, 2]; 0 is greedy.")
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1].")
    tools: list[FunctionTool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = Field(
        None,
        description='"auto" (the default with tools): calls are read from the answer; '
        '"required" or a function: the answer is constrained to calls.',
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call.")
    text: TextConfig | None = Field(None, description="format: the answer's structure.")
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = Field(None, description="Kept with the response.")
    user: str | None = Field(None, description=_IGNORED)
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description='Only "disabled": an input past the context is refused.'
    )
    # vLLM's sampling fields beyond OpenAI's, as in chat.
    top_k: int | None = Field(None, description="Keep the k most likely tokens; 0 or -1 disables.")
    min_p: float | None = Field(None, description="Drop tokens below min_p × the top probability.")
    presence_penalty: float | None = Field(None, description="In [-2, 2].")
    frequency_penalty: float | None = Field(None, description="In [-2, 2].")
    repetition_penalty: float | None = Field(None, description="In (0, 2]; 1 disables.")
    seed: int | None = Field(None, description="Makes sampling reproducible.")
    stop: str | list[str] | None = Field(None, description="Strings that end the generation.")
    priority: int = Field(0, description="Scheduling priority: lower values are served first.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (enable_thinking, ...)."
    )
    stream_options: Any = Field(None, description=_IGNORED)
    service_tier: Any = Field(None, description=_IGNORED)
    safety_identifier: Any = Field(None, description=_IGNORED)
    prompt_cache_key: Any = Field(None, description=_IGNORED)
    prompt_cache_retention: Any = Field(None, description=_IGNORED)
    max_tool_calls: Any = Field(None, description="Ignored: it bounds built-in tools, of which "
                                "this server has none.")  # fmt: skip
    background: Any = Field(None, description="Not supported: only false.")
    conversation: Any = Field(None, description="Not supported: only null.")
    prompt: Any = Field(None, description="Not supported: only null.")
    include: Any = Field(None, description="Not supported: only null or [].")
    top_logprobs: Any = Field(None, description="Not supported: only null.")
    context_management: Any = Field(None, description="Not supported: only null.")


def check_item_types(data: dict) -> None:
    """400 for an input item or a tool of a type this server does not take, naming
    where it is and its type (before validation, which would only say it matches
    no model)."""
    items = data.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in ITEM_TYPES:
            raise bad_request(
                f"input.{i}: items of type {kind[:64]!r} are not supported; this server "
                f"takes {', '.join(ITEM_TYPES)} items",
                f"input.{i}.type",
            )
    tools = data.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise bad_request(
                f"tools.{i}: tools of type {kind[:64]!r} are not supported; this server "
                "calls functions only",
                f"tools.{i}.type",
            )
