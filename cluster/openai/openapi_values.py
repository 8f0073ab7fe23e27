"""JSON Schema values for the OpenAPI description (:mod:`openapi`): the small
builders, and the ranges of vLLM's engine-side fields and of the fields that
constrain the output with a grammar."""

from __future__ import annotations

from ...scheduler.sampling import LOGIT_BIAS_RANGE, MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS
from .jobs import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def integer(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def number(lo: float, hi: float, *, lo_open: bool = False) -> dict:
    low = {"exclusiveMinimum": lo} if lo_open else {"minimum": lo}
    return {"type": "number", **low, "maximum": hi}


# What a refused field may hold: its "not used" values (fields.check_refused).
UNUSED = {
    "anyOf": [
        {"type": "null"},
        {"const": False},
        {"type": "string", "maxLength": 0},
        {"type": "array", "maxItems": 0},
        {"type": "object", "maxProperties": 0},
    ]
}


_NON_BLANK = {"type": "string", "pattern": "\\S"}
_REGEX = {"type": "string", "pattern": "^[^\\x00]+$"}  # a NUL is refused
_CHOICE = {"type": "array", "items": {"type": "string"}, "minItems": 1}
_SCHEMA = {
    "anyOf": [{"type": "object"}, {"type": "string", "contentMediaType": "application/json"}]
}


def extension_constraints(token_id: dict, max_logprobs: int) -> dict[str, dict]:
    """vLLM's engine-side fields and the ways of constraining the output."""
    return {
        "logit_bias": nullable(
            {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]{1,10}$"},
                "additionalProperties": number(*LOGIT_BIAS_RANGE),
                "maxProperties": MAX_LOGIT_BIAS,
            }
        ),
        "allowed_token_ids": nullable(
            {"type": "array", "items": token_id, "minItems": 1, "maxItems": MAX_ALLOWED_TOKEN_IDS}
        ),
        "bad_words": nullable(
            {
                "type": "array",
                "items": {**_NON_BLANK, "maxLength": MAX_BAD_WORD_CHARS},
                "maxItems": MAX_BAD_WORDS,
            }
        ),
        "prompt_logprobs": nullable(integer(0, max_logprobs)),
        "guided_json": nullable(_SCHEMA),
        "guided_regex": nullable(_REGEX),
        "guided_choice": nullable(_CHOICE),
        "guided_grammar": nullable(_NON_BLANK),
        "response_format": nullable(
            {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"type": {"enum": ["text", "json_object"]}},
                        "required": ["type"],
                    },
                    {
                        "type": "object",
                        "properties": {
                            "type": {"const": "json_schema"},
                            "json_schema": {"$ref": "#/components/schemas/JsonSchemaFormat"},
                        },
                        "required": ["type", "json_schema"],
                    },
                ]
            }
        ),
    }


def structured_outputs_schema(schema: dict) -> None:
    props = schema["properties"]
    for name, value in (("json", _SCHEMA), ("regex", _REGEX), ("choice", _CHOICE),
                        ("grammar", _NON_BLANK)):  # fmt: skip
        props[name] = {**nullable(value), "description": props[name].get("description", "")}
    props["structural_tag"] = {**UNUSED, "description": props["structural_tag"]["description"]}
