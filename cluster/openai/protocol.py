"""Request bodies of the OpenAI-compatible API, as pydantic models.

Values are strict: ``"0.5"`` is not a number and ``true`` is not an integer.
Names are lenient, as OpenAI's own API and vLLM are: a field this server does
not know is accepted and ignored (:mod:`fields` lists it in a response header
and logs it once), unless the server runs with ``strict_fields``. A field it
knows but cannot honour yet is refused with a 400 that names it and says why
(``REFUSED``), rather than silently ignored: the client asked for a different
output. Ranges are checked by :class:`~iterserve.scheduler.SamplingParams`,
whose messages name the field.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import APIError, bad_request
from .stream import MAX_STOP_LEN, MAX_STOP_STRINGS

MAX_PROMPTS = 64  # prompts in one completions request
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


class RequestModel(BaseModel):
    """Unknown names are kept aside (``model_extra``), for :mod:`fields` to report."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)


# What a client may send but this server cannot honour: field -> why. A field is
# refused when it holds anything but its "not used" value (null, false, {} or []).
REFUSED_COMMON = {
    "use_beam_search": "beam search is not supported by this server",
    "truncate_prompt_tokens": "prompt truncation is not supported by this server",
}
REFUSED_COMPLETION = {
    **REFUSED_COMMON,
    "suffix": "is not supported by this server",
}
REFUSED_CHAT = {
    **REFUSED_COMMON,
    "functions": "the legacy functions API is not supported; send tools instead",
    "function_call": "the legacy functions API is not supported; send tool_choice instead",
    "audio": "audio output is not supported by this server",
    "web_search_options": "web search is not supported by this server",
    "echo": "is not supported by this server (completions echo their prompt)",
    "chat_template": "cannot be sent with the request; the model's own chat template is used",
}
# Accepted because clients send them, and ignored: none changes what is generated.
_IGNORED = "Accepted and ignored."


class StreamOptions(RequestModel):
    include_usage: bool = Field(
        False, description="Send a last chunk with token usage (and no choices)."
    )
    continuous_usage_stats: bool = Field(
        False, description="With include_usage: every chunk carries the usage so far."
    )


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description='"text"; "json_object": any JSON object; "json_schema": the output '
        "follows json_schema.schema."
    )
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(RequestModel):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar,
    json_object."""

    json_: str | dict[str, Any] | None = Field(
        None, alias="json", description="A JSON schema (an object or its text)."
    )
    regex: str | None = Field(None, description="A regular expression the output matches.")
    choice: list[str] | None = Field(None, description="The output is one of these strings.")
    grammar: str | None = Field(None, description="A grammar: xgrammar's EBNF (::=), else Lark.")
    json_object: bool | None = Field(None, description="true: any JSON object.")
    structural_tag: Any = Field(None, description="Refused: structural tags are not supported.")
    whitespace_pattern: Any = Field(None, description=_IGNORED)
    disable_any_whitespace: Any = Field(None, description=_IGNORED)
    disable_additional_properties: Any = Field(None, description=_IGNORED)
    disable_fallback: Any = Field(None, description=_IGNORED)


class _Common(RequestModel):
    """Fields shared by both generation endpoints."""

    model: str = Field(description="The served model name, as listed by GET /v1/models.")
    max_tokens: int | None = Field(
        None,
        description="Most tokens to generate. Default: chat, the room left in the context; "
        "completions, 16 (or the room left, if less).",
    )
    max_completion_tokens: int | None = Field(None, description="Same as max_tokens; wins.")
    temperature: float | None = Field(
        None, description="Sampling temperature in [0, 2]; 0 is greedy."
    )
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1].")
    top_k: int | None = Field(None, description="Keep the k most likely tokens; 0 or -1 disables.")
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
    include_stop_str_in_output: bool = Field(
        False, description="Keep the matched stop string (or stop token's text) in the output."
    )
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    min_tokens: int | None = Field(None, description="Tokens to generate before EOS may end it.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    spaces_between_special_tokens: bool = Field(
        True, description="False: no space between two special tokens in the text."
    )
    priority: int = Field(0, description="Scheduling priority: lower values are served first.")
    stream: bool = Field(False, description="Stream Server-Sent Events ending in data: [DONE].")
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    return_tokens_as_token_ids: bool = Field(
        False, description='With logprobs: tokens are written "token_id:<id>".'
    )
    user: Any = Field(
        None,
        description="The tenant the request is served for under scheduling_policy fair "
        "(unless the x-gateway-inference-fairness-id header names one): a string of at most "
        "128 characters.",
    )
    metadata: Any = Field(None, description=_IGNORED)
    store: Any = Field(None, description=_IGNORED)
    service_tier: Any = Field(None, description=_IGNORED)
    request_id: Any = Field(None, description="Ignored: X-Request-Id names a request.")
    cache_salt: Any = Field(None, description=_IGNORED)
    kv_transfer_params: Any = Field(None, description=_IGNORED)
    vllm_xargs: Any = Field(None, description=_IGNORED)
    length_penalty: Any = Field(None, description="Ignored: it only applies to beam search.")
    guided_decoding_backend: Any = Field(None, description=_IGNORED)
    guided_whitespace_pattern: Any = Field(None, description=_IGNORED)
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> a bias in [-100, 100] added to its logit."
    )
    allowed_token_ids: list[int] | None = Field(
        None, description="Only these tokens may be generated."
    )
    bad_words: list[str] | None = Field(
        None, description="Words that are never generated (as they tokenize, with and without a "
        "leading space)."
    )  # fmt: skip
    prompt_logprobs: int | None = Field(
        None, description="Return each prompt token's logprob and this many alternatives."
    )
    guided_json: str | dict[str, Any] | None = Field(
        None, description="The output follows this JSON schema (an object or its text)."
    )
    guided_regex: str | None = Field(
        None, description="The output matches this regular expression."
    )
    guided_choice: list[str] | None = Field(None, description="The output is one of these strings.")
    guided_grammar: str | None = Field(
        None, description="The output follows this grammar: xgrammar's EBNF (with ::=), else Lark."
    )
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="vLLM's structured outputs: one of json, regex, choice, grammar, "
        "json_object."
    )  # fmt: skip
    use_beam_search: bool = Field(False, description="Only false: no beam search.")
    truncate_prompt_tokens: Any = Field(None, description="Not supported: only null.")

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

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value):
        if value is not None and value < -1:
            raise ValueError(f"must be -1 or 0 (off) or a positive count, got {value}")
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

    def output_len(self) -> tuple[int | None, str]:
        """The requested most tokens to generate, and the field it came from."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Common):
    """POST /v1/completions."""

    REFUSED: ClassVar[dict[str, str]] = REFUSED_COMPLETION

    prompt: Prompt = Field(
        description="A string, a list of strings, a list of token ids, or a list of such lists."
    )
    logprobs: int | None = Field(
        None, description="Return the log-probability of each token and of this many alternatives."
    )
    add_special_tokens: bool = Field(True, description="Add the tokenizer's BOS to text prompts.")
    echo: bool = Field(
        False, description="Return the prompt before the completion (with its logprobs when "
        "logprobs is set); max_tokens 0 returns the prompt alone."
    )  # fmt: skip
    best_of: int | None = Field(None, description="Only null or a value equal to n is accepted.")
    suffix: str | None = Field(None, description="Not supported: only null is accepted.")


class ContentPart(RequestModel):
    type: str = Field(description='Only "text" parts are supported.')
    text: str | None = None


class FunctionCall(RequestModel):
    name: str
    arguments: str | dict[str, Any] = Field(description="The arguments, as a JSON object text.")


class ToolCall(RequestModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: str = Field(
        description="system, user, assistant, tool (or any role the chat template knows)."
    )
    content: str | list[ContentPart] | None = Field(
        None, description="Text, or a list of text parts; null for an assistant's tool calls."
    )
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(
        None, description="An assistant's earlier tool calls, rendered by the chat template."
    )
    tool_call_id: str | None = Field(None, description="Which call a tool message answers.")
    reasoning_content: str | None = Field(None, description="Passed to the chat template.")
    refusal: Any = Field(None, description=_IGNORED)


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"] = Field(description="Only function tools.")
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    REFUSED: ClassVar[dict[str, str]] = REFUSED_CHAT

    messages: list[ChatMessage] = Field(
        description="The conversation, rendered with the model's own chat template."
    )
    logprobs: bool = Field(False, description="Return the log-probability of each output token.")
    top_logprobs: int | None = Field(
        None, description="With logprobs: also this many most likely alternatives per token."
    )
    tools: list[Tool] | None = Field(
        None, description="Functions the model may call, shown to it by the chat template."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description='"none"; "auto" (the default with tools): the output is parsed for calls; '
        '"required" or a named function: the output is constrained to calls.',
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one tool call per choice."
    )
    add_generation_prompt: bool | None = Field(
        None, description="Open the assistant's turn at the end of the prompt (default true)."
    )
    continue_final_message: bool = Field(
        False, description="Continue the last message instead of starting a new one."
    )
    add_special_tokens: bool = Field(
        False, description="Add the tokenizer's BOS on top of what the template writes."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template."
    )
    documents: list[dict[str, Any]] | None = Field(
        None, description="Passed to the chat template (retrieval templates)."
    )
    reasoning_effort: str | None = Field(None, description="Passed to the chat template.")
    chat_template: Any = Field(
        None, description="Refused: the server only renders the model's own chat template."
    )
    modalities: list[Literal["text"]] | None = Field(None, description='Only ["text"].')
    functions: Any = Field(None, description="Refused: send tools.")
    function_call: Any = Field(None, description="Refused: send tool_choice.")
    audio: Any = Field(None, description="Refused: no audio output.")
    web_search_options: Any = Field(None, description="Refused: no web search.")
    echo: bool = Field(False, description="Not supported: only false.")
    prediction: Any = Field(None, description=_IGNORED)
    verbosity: Any = Field(None, description=_IGNORED)
    prompt_cache_key: Any = Field(None, description=_IGNORED)
    safety_identifier: Any = Field(None, description=_IGNORED)
    include_reasoning: bool = Field(
        True, description="With a reasoning parser: false leaves the reasoning out of the answer."
    )
    mm_processor_kwargs: Any = Field(None, description=_IGNORED)
    media_io_kwargs: Any = Field(None, description=_IGNORED)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}
_UNION_HINTS = {  # what a union-typed field accepts, said once instead of per member
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string, a list of text parts or null",
    "tool_choice": 'must be "none", "auto", "required" or {"type": "function", '
    '"function": {"name": ...}}',
    "arguments": "must be a JSON object as text",
    "guided_json": "must be a JSON schema: an object or its text",
    "json": "must be a JSON schema: an object or its text",
}


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the field."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    loc = [str(p) for p in first["loc"]]
    # Union members and tagged types add path items of their own ("str", "list[...]",
    # "literal['none','auto']", "NamedToolChoice"): keep the field names and indices.
    path = [p for p in loc if p not in _TYPE_TAGS and "[" not in p and not p[:1].isupper()]
    name = ".".join(path)
    field = next((p for p in reversed(path) if not p.isdigit()), "")
    if len(path) < len(loc) and field in _UNION_HINTS:
        return bad_request(f"{name}: {_UNION_HINTS[field]}", param=name)
    message = first["msg"].removeprefix("Value error, ")
    return bad_request(f"{name}: {message}" if name else message, param=name or None)
