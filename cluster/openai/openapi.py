"""The OpenAPI 3.1 description of the HTTP API, served at GET /openapi.json.

The request bodies come from the pydantic models in :mod:`protocol` (field
names, types, descriptions; ``additionalProperties`` false only with
``strict_fields``, since unknown names are otherwise ignored); the ranges that
:class:`~iterserve.scheduler.SamplingParams` and the handlers check are laid
over them here, with the limits of the running engine (context length,
vocabulary, ``max_n``, ``max_logprobs``). A body the schema accepts is served,
except where one field constrains another — JSON Schema cannot say that, so
the operation descriptions do (``CROSS_FIELD_RULES``).
"""

from __future__ import annotations

import copy
from typing import Any

from ...scheduler.sampling import MAX_SEED, MAX_STOP_TOKEN_IDS
from .chat import RESERVED_TEMPLATE_VARIABLES
from .embeddings import EMBEDDING_RULES, EmbeddingRequest, embedding_constraints
from .openapi_values import (
    UNUSED,
    extension_constraints,
    integer,
    nullable,
    number,
    structured_outputs_schema,
)
from .protocol import (
    MAX_PROMPTS,
    PRIORITY_RANGE,
    ChatCompletionRequest,
    CompletionRequest,
)
from .responses.openapi import responses_constraints, responses_paths, responses_schemas
from .responses.protocol import ResponsesRequest
from .stream import MAX_STOP_LEN, MAX_STOP_STRINGS
from .tokenize import DetokenizeRequest, TokenizeRequest

CROSS_FIELD_RULES = (
    "Rules across fields: the prompt's tokens plus max_tokens must fit in the context "
    "(400, code context_length_exceeded); min_tokens <= max_tokens; max_tokens 0 only with "
    "echo; stream_options only with stream: true; best_of equals n; top_logprobs needs "
    "logprobs: true; max_completion_tokens overrides max_tokens; tool_choice other than none "
    "needs tools, and a named function must be one of them; tools with tool_choice auto (the "
    "default with tools) need a server started with a tool-call parser; "
    "continue_final_message excludes add_generation_prompt: true; a message's content may be "
    "null only for an assistant's tool_calls, whose arguments are a JSON object (as text); "
    "chat_template_kwargs cannot set the template's own variables; logit_bias keys are token "
    "ids of the vocabulary. Structured outputs: at most one of response_format (json_object "
    "or json_schema), guided_json, guided_regex, guided_choice, guided_grammar, "
    "structured_outputs (one of its json, regex, choice, grammar, json_object) and "
    "tool_choice required or a named function; its grammar must compile within a few "
    "seconds (400 otherwise), and it excludes ignore_eos, min_tokens, allowed_token_ids "
    "and bad_words."
)
_ERROR_STATUSES = {
    "400": "Invalid body or field (the message names it).",
    "401": "Missing or wrong API key.",
    "404": "Unknown model.",
    "413": "Body over max_body_bytes.",
    "415": "Content-Type is not application/json.",
    "429": "The engine's waiting queue is full; see Retry-After.",
    "503": "No engine replica can serve; see Retry-After.",
    "504": "The request ran past request_timeout_s.",
}


def field_constraints(
    *,
    max_model_len: int,
    vocab_size: int,
    max_n: int,
    max_logprobs: int,
    tool_call_parser: str | None = None,
    hidden_size: int | None = None,
):
    """The value schema of every field whose range the server checks."""
    token_id = integer(0, vocab_size - 1)
    max_tokens = integer(1, max_model_len - 1)  # every prompt holds at least one token
    token_list = {"type": "array", "items": token_id, "minItems": 1, "maxItems": max_model_len - 1}
    stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN}
    common = {
        "truncate_prompt_tokens": UNUSED,  # refused unless unused
        **extension_constraints(token_id, max_logprobs),
        "max_tokens": nullable(max_tokens),
        "max_completion_tokens": nullable(max_tokens),
        "temperature": nullable(number(0.0, 2.0)),
        "top_p": nullable(number(0.0, 1.0, lo_open=True)),
        "top_k": nullable(integer(-1, 1 << 30)),
        "min_p": nullable(number(0.0, 1.0)),
        "presence_penalty": nullable(number(-2.0, 2.0)),
        "frequency_penalty": nullable(number(-2.0, 2.0)),
        "repetition_penalty": nullable(number(0.0, 2.0, lo_open=True)),
        "seed": nullable(integer(0, MAX_SEED)),
        "n": integer(1, max_n),
        "stop": {
            "anyOf": [
                stop_string,
                {"type": "array", "items": stop_string, "maxItems": MAX_STOP_STRINGS},
                {"type": "null"},
            ]
        },
        "stop_token_ids": nullable(
            {"type": "array", "items": token_id, "maxItems": MAX_STOP_TOKEN_IDS}
        ),
        "min_tokens": nullable(integer(0, max_model_len - 1)),
        "priority": integer(*PRIORITY_RANGE),
        "use_beam_search": {"type": "boolean", "const": False},
    }
    completion = {
        **common,
        # 0 computes the prompt alone: only with echo (a rule across fields).
        "max_tokens": nullable(integer(0, max_model_len - 1)),
        "max_completion_tokens": nullable(integer(0, max_model_len - 1)),
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {"type": "string"},
                    "minItems": 1,
                    "maxItems": MAX_PROMPTS,
                },
                token_list,
                {"type": "array", "items": token_list, "minItems": 1, "maxItems": MAX_PROMPTS},
            ]
        },
        "logprobs": nullable(integer(0, max_logprobs)),
        "best_of": nullable(integer(1, max_n)),
        "suffix": nullable({"type": "string", "maxLength": 0}),
    }
    chat = {
        **common,
        "messages": {
            "type": "array",
            "items": {"$ref": "#/components/schemas/ChatMessage"},
            "minItems": 1,
        },
        "top_logprobs": nullable(integer(0, max_logprobs)),
        "tool_choice": nullable(
            {
                "anyOf": [
                    {
                        "type": "string",
                        "enum": ["none", "auto", "required"]
                        if tool_call_parser
                        else ["none", "required"],
                    },
                    {"$ref": "#/components/schemas/NamedToolChoice"},
                ]
            }
        ),  # fmt: skip
        "chat_template_kwargs": nullable(
            {
                "type": "object",
                "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_VARIABLES)}},
            }
        ),
        "chat_template": UNUSED,
        "echo": {"type": "boolean", "const": False},
        **{name: UNUSED for name in ("functions", "function_call", "audio", "web_search_options")},
    }
    responses = responses_constraints(chat, max_model_len)
    return completion, chat, responses, embedding_constraints(completion, hidden_size)


def _request_schemas(limits: dict[str, Any], strict_fields: bool) -> dict[str, dict]:
    """Component schemas: the pydantic models, with the checked ranges laid over."""
    template = "#/components/schemas/{model}"
    schemas: dict[str, dict] = {}
    overlays = field_constraints(**limits)
    models = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, EmbeddingRequest,
              TokenizeRequest, DetokenizeRequest)  # fmt: skip
    for model, overlay in zip(models, (*overlays, {}, {})):
        schema = copy.deepcopy(model.model_json_schema(ref_template=template))
        schemas.update(schema.pop("$defs", {}))
        unknown = set(overlay) - set(schema["properties"])
        assert not unknown, f"constraints for fields {model.__name__} lacks: {unknown}"
        for name, value_schema in overlay.items():
            prop = schema["properties"][name]
            keep = {k: prop[k] for k in ("description", "default", "title") if k in prop}
            schema["properties"][name] = {**value_schema, **keep}
        schemas[model.__name__] = schema
    message = schemas["ChatMessage"]["properties"]
    message["role"] = {
        "type": "string",
        "enum": ["system", "user", "assistant"],
        "description": "Who speaks; the model's chat template refuses other roles.",
    }
    structured_outputs_schema(schemas["StructuredOutputsParams"])
    text_part = schemas["ContentPart"]
    text_part["properties"]["type"] = {"const": "text"}
    text_part["properties"]["text"] = {"type": "string"}
    text_part["required"] = ["type", "text"]
    arguments = schemas["FunctionCall"]["properties"]["arguments"]
    arguments["anyOf"] = [
        {"type": "string", "contentMediaType": "application/json"},
        {"type": "object"},
    ]
    # Unknown names are ignored, unless the server refuses them (strict_fields).
    for schema in schemas.values():
        if schema.get("type") == "object" and "properties" in schema:
            schema["additionalProperties"] = not strict_fields
    return schemas


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _generation(summary: str, request: str) -> dict:
    errors = {
        status: {"description": text, **_json({"$ref": "#/components/schemas/Error"})}
        for status, text in _ERROR_STATUSES.items()
    }
    ok = _json({"type": "object"})
    ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "description": CROSS_FIELD_RULES,
            "operationId": request,
            "requestBody": {"required": True, **_json({"$ref": f"#/components/schemas/{request}"})},
            "responses": {
                "200": {"description": "The generation (SSE when stream).", **ok},
                **errors,
            },
        }
    }


def _post(summary: str, request: str) -> dict:
    error = {"description": "An error.", **_json({"$ref": "#/components/schemas/Error"})}
    return {
        "post": {
            "summary": summary,
            "operationId": request,
            "requestBody": {"required": True, **_json({"$ref": f"#/components/schemas/{request}"})},
            "responses": {
                "200": {"description": "OK", **_json({"type": "object"})},
                "default": error,
            },
        }
    }


def _get(summary: str, operation_id: str, content: dict | None = None, **extra: Any) -> dict:
    ok = content or _json({"type": "object"})
    error = {"description": "An error.", **_json({"$ref": "#/components/schemas/Error"})}
    return {
        "get": {
            "summary": summary,
            "operationId": operation_id,
            "responses": {"200": {"description": "OK", **ok}, "default": error},
            **extra,
        }
    }


def _operator_paths() -> dict:
    """vLLM's operator routes (:mod:`.operator`): actions by query parameter, no body."""
    from ..engine.pause import PAUSE_MODES, SLEEP_LEVELS
    from .operator import WAKE_TAGS

    def query(name: str, schema: dict) -> dict:
        return {"name": name, "in": "query", "required": False, "schema": schema}

    mode = query("mode", {"type": "string", "enum": list(PAUSE_MODES), "default": "abort"})
    level = query("level", {"type": "integer", "enum": list(SLEEP_LEVELS), "default": 1})
    tags = query("tags", {"type": "array", "items": {"type": "string", "enum": list(WAKE_TAGS)}})

    def action(summary: str, operation_id: str, parameters: list[dict]) -> dict:
        return {"post": _get(summary, operation_id, parameters=parameters)["get"]}

    return {
        "/pause": action("Stop generating on every engine replica: abort what runs, wait "
                         "for it, or keep it for /resume", "pause", [mode]),
        "/resume": action("Generate again (409 while asleep)", "resume", []),
        "/is_paused": _get("Whether every engine replica is paused", "isPaused"),
        "/sleep": action("Pause (mode), then release the ranks' weights and KV cache", "sleep",
                         [level, mode]),
        "/wake_up": action("Re-acquire them, and end a pause the sleep made", "wakeUp", [tags]),
        "/is_sleeping": _get("Whether any engine replica is asleep", "isSleeping"),
    }  # fmt: skip


def openapi_schema(
    *,
    model_name: str,
    max_model_len: int,
    vocab_size: int,
    max_n: int,
    max_logprobs: int,
    tool_call_parser: str | None = None,
    strict_fields: bool = False,
    runner: str = "generate",
    hidden_size: int | None = None,
) -> dict:
    """The whole API as an OpenAPI 3.1 document, for this server's model and limits:
    the generation routes, or with ``runner: pooling`` the embeddings route."""
    limits = dict(
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        max_n=max_n,
        max_logprobs=max_logprobs,
        tool_call_parser=tool_call_parser,
        hidden_size=hidden_size,
    )
    schemas = _request_schemas(limits, strict_fields)
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        model = schemas[request]["properties"]["model"]
        schemas[request]["properties"]["model"] = {**model, "enum": [model_name]}
    responses_schemas(schemas, model_name)
    model = schemas["EmbeddingRequest"]["properties"]["model"]
    schemas["EmbeddingRequest"]["properties"]["model"] = {
        **model,
        **nullable({"enum": [model_name]}),
    }
    error_fields = ("message", "type", "param", "code", "request_id")
    schemas["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": list(error_fields[:4]),
                "properties": {name: {"type": ["string", "null"]} for name in error_fields},
            }
        },
    }
    model_id = {
        "name": "model_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "enum": [model_name]},
    }
    if runner == "pooling":
        embeddings = _generation("Embeddings of the inputs", "EmbeddingRequest")
        embeddings["post"]["description"] = EMBEDDING_RULES
        served = {"/v1/embeddings": embeddings}
    else:
        served = {
            "/v1/completions": _generation("Text completion", "CompletionRequest"),
            "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest"),
            **responses_paths(
                _generation("Create a response (Open Responses)", "ResponsesRequest"),
                {"description": "An error.", **_json({"$ref": "#/components/schemas/Error"})},
            ),
        }
    paths = {
        **served,
        "/v1/models": _get("The served model", "listModels"),
        "/v1/models/{model_id}": _get("One model", "getModel", parameters=[model_id]),
        "/v1/stats": _get("Engine state summed over replicas", "getStats"),
        "/tokenize": _post("Token ids of a prompt or of chat messages", "TokenizeRequest"),
        "/detokenize": _post("The text of token ids", "DetokenizeRequest"),
        "/version": _get("The server's version", "getVersion"),
        **_operator_paths(),
        "/health": _get("200 when every engine replica serves, else 503", "health", security=[]),
        "/metrics": _get(
            "Prometheus metrics",
            "metrics",
            {"content": {"text/plain": {"schema": {"type": "string"}}}},
        ),
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "iterserve", "version": "1", "description": CROSS_FIELD_RULES},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
