"""The Responses API in the OpenAPI document (:mod:`..openapi`): the ranges of its
request's fields, its component schemas' rules, its paths."""

from __future__ import annotations

from typing import Any

from ..openapi_values import UNUSED, integer, nullable
from .protocol import REFUSED_RESPONSES

RESPONSES_RULES = (
    "Rules across fields: the input (rendered with the chat template, instructions and "
    "the previous response's conversation included) plus max_output_tokens must fit in "
    "the context (400, code context_length_exceeded); previous_response_id names a stored "
    "response (404 otherwise); the input holds a message or a call (not reasoning items "
    "alone); a function_call's arguments are a JSON object (as text); "
    "a function_call_output is rendered as a tool message, which the model's chat template "
    "must know; tool_choice other than none needs tools, and a named function must be one "
    "of them; tools with tool_choice auto (the default with tools) need a server started "
    "with a tool-call parser; text.format json_schema needs name and schema, and at most "
    "one of text.format (json_object, json_schema) and tool_choice required or a named "
    "function constrains the output; its grammar must compile within a few seconds."
)
_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "priority", "chat_template_kwargs",
)  # fmt: skip
_ITEMS = ("MessageItem", "FunctionCallItem", "FunctionCallOutputItem", "ReasoningItem")


def responses_constraints(chat: dict[str, dict], max_model_len: int) -> dict[str, dict]:
    """The value schema of every field of ResponsesRequest the server checks; ``chat``:
    chat's, whose sampling fields the Responses API shares."""
    refs = [{"$ref": f"#/components/schemas/{name}"} for name in _ITEMS]
    choice = chat["tool_choice"]["anyOf"][0]["anyOf"][0]
    return {
        **{name: chat[name] for name in _SAMPLING},
        "input": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"oneOf": refs}, "minItems": 1},
            ]
        },
        "max_output_tokens": nullable(integer(1, max_model_len - 1)),
        "tool_choice": nullable(
            {"anyOf": [choice, {"$ref": "#/components/schemas/FunctionChoice"}]}
        ),
        "truncation": nullable({"const": "disabled"}),
        **{name: UNUSED for name in REFUSED_RESPONSES},
    }


def responses_schemas(schemas: dict[str, dict], model_name: str) -> None:
    """Rules of the component schemas JSON Schema can state."""
    request = schemas["ResponsesRequest"]["properties"]
    request["model"] = {**nullable({"enum": [model_name]}), "description": "The served model."}
    form = schemas["TextFormat"]
    form["anyOf"] = [
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {"properties": {"type": {"const": "json_schema"}}, "required": ["name", "schema"]},
    ]
    arguments = schemas["FunctionCallItem"]["properties"]["arguments"]
    arguments["contentMediaType"] = "application/json"
    reasoning = schemas["ReasoningItem"]["properties"]
    reasoning["encrypted_content"] = {"type": "null", "description": "Not supported: only null."}


def responses_paths(generation: dict, error: dict) -> dict[str, Any]:
    """``generation``: the POST operation (as the other generation routes'); ``error``:
    the error response."""
    response_id = {"name": "response_id", "in": "path", "required": True,
                   "schema": {"type": "string"}}  # fmt: skip
    generation["post"]["description"] = RESPONSES_RULES

    def operation(summary: str, operation_id: str) -> dict:
        ok = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
        return {
            "summary": summary,
            "operationId": operation_id,
            "parameters": [response_id],
            "responses": {"200": ok, "404": {**error, "description": "Not stored."}},
        }

    return {
        "/v1/responses": generation,
        "/v1/responses/{response_id}": {
            "get": operation("A stored response", "getResponse"),
            "delete": operation("Delete a stored response", "deleteResponse"),
        },
    }
