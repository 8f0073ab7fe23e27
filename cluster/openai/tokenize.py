"""POST /tokenize and POST /detokenize, in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (text, tokenized as /v1/completions does) or
``messages`` (rendered with the chat template as /v1/chat/completions does,
with the same template options) and answers ``{"count", "max_model_len",
"tokens", "token_strs"}``; ``/detokenize`` takes ``tokens`` and answers
``{"prompt"}``. ``model`` is optional; when sent it must be the served name.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from starlette.responses import JSONResponse

from .errors import bad_request
from .protocol import ChatMessage, RequestModel, Tool
from .serving import OpenAIServing, load_json


class TokenizeRequest(RequestModel):
    """POST /tokenize of a text prompt."""

    model: str | None = None
    prompt: str = Field(description="The text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's BOS.")
    return_token_strs: bool = Field(False, description="Also return each token's string.")


class TokenizeChatRequest(RequestModel):
    """POST /tokenize of a conversation, rendered as /v1/chat/completions renders it."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    return_token_strs: bool = False
    chat_template: Any = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int] = Field(description="Token ids to turn back into text.")


async def tokenize(serving: OpenAIServing, body: bytes) -> JSONResponse:
    data = load_json(body)
    chat = "messages" in data
    request, headers = serving.validate(TokenizeChatRequest if chat else TokenizeRequest, data)
    if chat:
        if request.chat_template is not None:
            raise bad_request(
                "chat_template: the model's own chat template is used", "chat_template"
            )
        ids = await serving.chat_prompt(request)
    else:
        ids = await serving.encode(request.prompt, "prompt", request.add_special_tokens)
    info = await serving.engine_info()
    tokenizer = serving.tokenizer
    strs = [tokenizer.id_to_token(i) or "" for i in ids] if request.return_token_strs else None
    answer = {
        "count": len(ids),
        "max_model_len": info["max_model_len"],
        "tokens": ids,
        "token_strs": strs,
    }
    return JSONResponse(answer, headers=headers)


async def detokenize(serving: OpenAIServing, body: bytes) -> JSONResponse:
    request, headers = serving.parse(DetokenizeRequest, body)
    vocab_size = (await serving.engine_info())["vocab_size"]
    bad = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"tokens: token ids must be in [0, {vocab_size - 1}], got {bad}", "tokens"
        )
    text = serving.tokenizer.decode(request.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text}, headers=headers)
