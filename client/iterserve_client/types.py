"""Typed responses in OpenAI's shapes.

Parsing is lenient: fields the OpenAI schema defines are typed, anything else
the server adds is ignored, and a missing field takes its default. Each type
has ``from_dict``; the raw dict of a top-level response stays in ``.raw``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def _pick(cls: type[T], data: Any, **parsed: Any) -> T:
    """``cls`` from the keys of ``data`` it declares; ``parsed`` overrides nested ones."""
    data = data if isinstance(data, dict) else {}
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {k: v for k, v in data.items() if k in names and k not in parsed}
    if "raw" in names:
        values["raw"] = data
    return cls(**values, **parsed)


def _list(cls: Any, items: Any) -> list:
    return [cls.from_dict(item) for item in items or []]


def _opt(cls: Any, data: Any) -> Any:
    return cls.from_dict(data) if isinstance(data, dict) else None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def from_dict(cls, data: Any) -> Usage:
        return _pick(cls, data)


# -- logprobs -----------------------------------------------------------------------------


@dataclass
class CompletionLogprobs:
    """Completions' logprobs: parallel lists, one entry per output token."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Any) -> CompletionLogprobs:
        return _pick(cls, data)


@dataclass
class TopLogprob:
    token: str = ""
    logprob: float = 0.0
    bytes: list[int] | None = None

    @classmethod
    def from_dict(cls, data: Any) -> TopLogprob:
        return _pick(cls, data)


@dataclass
class TokenLogprob:
    """One output token of a chat completion, with its most likely alternatives."""

    token: str = ""
    logprob: float = 0.0
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Any) -> TokenLogprob:
        return _pick(cls, data, top_logprobs=_list(TopLogprob, (data or {}).get("top_logprobs")))


@dataclass
class ChatLogprobs:
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None

    @classmethod
    def from_dict(cls, data: Any) -> ChatLogprobs:
        content, refusal = (data or {}).get("content"), (data or {}).get("refusal")
        return cls(
            content=None if content is None else _list(TokenLogprob, content),
            refusal=None if refusal is None else _list(TokenLogprob, refusal),
        )


# -- completions --------------------------------------------------------------------------


@dataclass
class CompletionChoice:
    index: int = 0
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None

    @classmethod
    def from_dict(cls, data: Any) -> CompletionChoice:
        return _pick(cls, data, logprobs=_opt(CompletionLogprobs, (data or {}).get("logprobs")))


@dataclass
class Completion:
    """The answer of ``POST /v1/completions``; choice ``i`` of prompt ``p`` has index ``p * n + i``."""

    id: str = ""
    object: str = "text_completion"
    created: int = 0
    model: str = ""
    choices: list[CompletionChoice] = field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: Any) -> Completion:
        return _pick(
            cls,
            data,
            choices=_list(CompletionChoice, data.get("choices")),
            usage=_opt(Usage, data.get("usage")),
        )


@dataclass
class CompletionChunk(Completion):
    """One streamed piece of a completion: each choice carries the new ``text``.

    With ``stream_options={"include_usage": True}`` the last chunk has no
    choices and carries ``usage``.
    """


# -- chat -------------------------------------------------------------------------------


@dataclass
class ChatMessage:
    """A message of the conversation, sent or received. ``tool_calls`` are in
    OpenAI's shape (``{"id", "type": "function", "function": {"name",
    "arguments"}}``); a ``tool`` message answers one by ``tool_call_id``."""

    role: str = "assistant"
    content: str | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @classmethod
    def from_dict(cls, data: Any) -> ChatMessage:
        return _pick(cls, data)

    def to_dict(self) -> dict[str, Any]:
        body = {"role": self.role, "content": self.content}
        optional = ("name", "refusal", "tool_calls", "tool_call_id")
        body.update({k: getattr(self, k) for k in optional if getattr(self, k)})
        return body


@dataclass
class ChatCompletionChoice:
    index: int = 0
    message: ChatMessage = field(default_factory=ChatMessage)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None

    @classmethod
    def from_dict(cls, data: Any) -> ChatCompletionChoice:
        data = data or {}
        return _pick(
            cls,
            data,
            message=ChatMessage.from_dict(data.get("message")),
            logprobs=_opt(ChatLogprobs, data.get("logprobs")),
        )


@dataclass
class ChatCompletion:
    """The answer of ``POST /v1/chat/completions``."""

    id: str = ""
    object: str = "chat.completion"
    created: int = 0
    model: str = ""
    choices: list[ChatCompletionChoice] = field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: Any) -> ChatCompletion:
        return _pick(
            cls,
            data,
            choices=_list(ChatCompletionChoice, data.get("choices")),
            usage=_opt(Usage, data.get("usage")),
        )


@dataclass
class ChoiceDelta:
    """What a chat chunk adds to a message: the role once, then content pieces and
    ``tool_calls`` entries (each with its ``index`` among the choice's calls)."""

    role: str | None = None
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @classmethod
    def from_dict(cls, data: Any) -> ChoiceDelta:
        return _pick(cls, data)


@dataclass
class ChatCompletionChunkChoice:
    index: int = 0
    delta: ChoiceDelta = field(default_factory=ChoiceDelta)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None

    @classmethod
    def from_dict(cls, data: Any) -> ChatCompletionChunkChoice:
        data = data or {}
        return _pick(
            cls,
            data,
            delta=ChoiceDelta.from_dict(data.get("delta")),
            logprobs=_opt(ChatLogprobs, data.get("logprobs")),
        )


@dataclass
class ChatCompletionChunk:
    """One streamed piece of a chat completion."""

    id: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str = ""
    choices: list[ChatCompletionChunkChoice] = field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: Any) -> ChatCompletionChunk:
        return _pick(
            cls,
            data,
            choices=_list(ChatCompletionChunkChoice, data.get("choices")),
            usage=_opt(Usage, data.get("usage")),
        )


# -- models and health --------------------------------------------------------------------


@dataclass
class Model:
    id: str = ""
    object: str = "model"
    created: int = 0
    owned_by: str = ""
    # A LoRA adapter: the model it adapts (``parent``) and where it was read (``root``).
    parent: str | None = None
    root: str | None = None

    @classmethod
    def from_dict(cls, data: Any) -> Model:
        return _pick(cls, data)


@dataclass
class Health:
    """``GET /health``: truthy when the server answered 200."""

    healthy: bool
    status_code: int
    message: str = ""
    body: Any = None

    def __bool__(self) -> bool:
        return self.healthy
