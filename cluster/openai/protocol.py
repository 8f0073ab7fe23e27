"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Strict: an unknown field is refused with a 400 that names it, and values are not
coerced (``"0.5"`` is not a number, ``true`` is not an integer). A few fields
that OpenAI clients commonly send are accepted: ``user`` (ignored),
``stream_options``, and ``logit_bias``/``tools``/``response_format`` only in their
"not used" forms; anything that would change the output and is not implemented
is refused rather than silently ignored. Ranges are checked by
:class:`~iterserve.scheduler.SamplingParams`, whose messages name the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from iterserve.cluster.openai.errors import APIError, bad_request
from iterserve.cluster.openai.stream import MAX_STOP_LEN, MAX_STOP_STRINGS

MAX_PROMPTS = 64  # prompts in one completions request
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = Field(
        False, description="Send a last chunk with token usage (and no choices)."
    )


class _Common(StrictModel):
    """Fields shared by both generation endpoints."""

    model: str = Field(description="The served model name, as listed by GET /v1/models.")
    max_tokens: int | None = Field(
        None, description="Most tokens to generate. Default: the room left in the context."
    )
    temperature: float | None = Field(
        None, description="Sampling temperature in [0, 2]; 0 is greedy."
    )
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1].")
    top_k: int | None = Field(None, description="Keep the k most likely tokens; 0 disables.")
    min_p: float | None = Field(None, description="Drop tokens below min_p × the top probability.")
    presence_penalty: float | None = Field(None, description="In [-2, 2].")
    frequency_penalty: float | None = Field(None, description="In [-2, 2].")
    repetition_penalty: float | None = Field(None, description="In (0, 2]; 1 disables.")
    seed: int | None = Field(
        None, description="Makes sampling reproducible; choice i of n uses seed + i."
    )
    n: int = Field(1, description="Choices to generate for each prompt.")
    stop: str | list[str] | None = Field(
        None,
        description=f"Up to {MAX_STOP_STRINGS} strings ({MAX_STOP_LEN} characters each) "
        "that end the generation; the text returned stops before them.",
    )
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end the generation.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    min_tokens: int | None = Field(None, description="Tokens to generate before EOS may end it.")
    priority: int = Field(0, description="Scheduling priority: lower values are served first.")
    stream: bool = Field(False, description="Stream Server-Sent Events ending in data: [DONE].")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="Accepted for compatibility and ignored.")
    logit_bias: dict[str, Any] | None = Field(
        None, description="Not supported: only null or an empty object is accepted."
    )

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported by this server")
        return value

    @field_validator("priority")
    @classmethod
    def _priority_range(cls, value):
        lo, hi = PRIORITY_RANGE
        if not lo <= value <= hi:
            raise ValueError(f"must be in [{lo}, {hi}], got {value}")
        return value

    @field_validator("n")
    @classmethod
    def _n_positive(cls, value):
        if value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_caps(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for stop in stops:
            if not 1 <= len(stop) <= MAX_STOP_LEN:
                raise ValueError(
                    f"each stop string must have 1 to {MAX_STOP_LEN} characters, got {len(stop)}"
                )
        return value

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: Prompt = Field(
        description="A string, a list of strings, a list of token ids, or a list of such lists."
    )
    logprobs: int | None = Field(
        None, description="Return the log-probability of each token and of this many alternatives."
    )
    echo: bool = Field(False, description="Not supported: only false is accepted.")
    best_of: int | None = Field(None, description="Only null or a value equal to n is accepted.")
    suffix: str | None = Field(None, description="Not supported: only null is accepted.")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        if value:
            raise ValueError("echo is not supported by this server")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported by this server")
        return value


class TextPart(StrictModel):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str


class ChatMessage(StrictModel):
    role: str = Field(description="system, user, assistant (or any role the chat template knows).")
    content: str | list[TextPart] | None = Field(description="Text, or a list of text parts.")
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            text = "\n".join(part.text for part in self.content)
        else:
            text = self.content or ""
        message = {"role": self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(StrictModel):
    type: Literal["text"] = Field(description="Only plain text output is supported.")


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(
        description="The conversation, rendered with the model's own chat template."
    )
    max_completion_tokens: int | None = Field(None, description="Same as max_tokens.")
    logprobs: bool = Field(False, description="Return the log-probability of each output token.")
    top_logprobs: int | None = Field(
        None, description="With logprobs: also this many most likely alternatives per token."
    )
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = Field(None, description="Not supported: only null or [] is accepted.")
    tool_choice: Literal["none"] | None = Field(None, description='Only "none" is accepted.')
    parallel_tool_calls: bool | None = Field(None, description="Accepted and ignored (no tools).")
    chat_template: Any = Field(
        None, description="Refused: the server only renders the model's own chat template."
    )

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value):
        if value:
            raise ValueError("tools are not supported by this server")
        return value

    @field_validator("chat_template")
    @classmethod
    def _no_template(cls, value):
        if value is not None:
            raise ValueError(
                "a chat template cannot be supplied with the request; "
                "the model's own template is used"
            )
        return value


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}
_UNION_HINTS = {  # what a union-typed field accepts, said once instead of per member
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of text parts",
}


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the field (all unknown fields at once)."""
    errors = exc.errors(include_url=False, include_input=False)
    unknown = [".".join(map(str, e["loc"])) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return bad_request(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    first = errors[0]
    loc = [str(p) for p in first["loc"]]
    path = [p for p in loc if p not in _TYPE_TAGS and "[" not in p]
    name = ".".join(path)
    field = next((p for p in reversed(path) if not p.isdigit()), "")
    if len(path) < len(loc) and field in _UNION_HINTS:
        return bad_request(f"{name}: {_UNION_HINTS[field]}", param=name)
    message = first["msg"].removeprefix("Value error, ")
    return bad_request(f"{name}: {message}" if name else message, param=name or None)
