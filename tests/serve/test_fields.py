"""Which request fields are honoured, ignored or refused (HTTP layer, no Ray).

Unknown names are accepted, listed in ``x-iterserve-ignored-fields`` and logged
once; ``strict_fields`` refuses them. Known fields the server cannot honour are
refused by name with the reason, and never reach the engine.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from iterserve.cluster.openai.fields import IGNORED_FIELDS_HEADER
from iterserve.cluster.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
)
from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import MODEL, inproc, sse_events

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hello world"}]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def app(tools_tokenizer_dir):
    return inproc(tools_tokenizer_dir)


@pytest.fixture
def http(app):
    return app[0]


def chat(http, **fields):
    return http.post(CHAT, json={"model": MODEL, "messages": MESSAGES, **fields})


def test_unknown_fields_are_ignored_and_named_in_a_header(http):
    messages = [{**MESSAGES[0], "cache_control": {"type": "ephemeral"}}]
    r = http.post(CHAT, json={"model": MODEL, "messages": messages, "foo": 1, "x_trace": "t"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "hello world"
    assert r.headers[IGNORED_FIELDS_HEADER] == "foo, x_trace, messages.*.cache_control"
    nested = {"model": MODEL, "prompt": "hi", "stream": True}
    nested["stream_options"] = {"include_usage": True, "chunk_size": 3}
    with http.stream("POST", COMPLETIONS, json=nested) as r:
        assert r.status_code == 200
        assert r.headers[IGNORED_FIELDS_HEADER] == "stream_options.chunk_size"
        sse_events(r.iter_lines())


def test_a_request_without_unknown_fields_has_no_header(http):
    r = chat(http, user="u1", metadata={"a": "b"}, store=False, service_tier="auto")
    assert r.status_code == 200 and IGNORED_FIELDS_HEADER not in r.headers


def test_each_unknown_name_is_logged_once(http, caplog):
    with caplog.at_level(logging.WARNING, logger="iterserve.cluster.openai.fields"):
        for _ in range(3):
            assert chat(http, only_here_once=1).status_code == 200
        assert chat(http, only_here_once=1, and_another=2).status_code == 200
    logged = [r.getMessage() for r in caplog.records if "not known" in r.getMessage()]
    assert len(logged) == 2
    assert "only_here_once" in logged[0] and "and_another" in logged[1]
    assert "only_here_once" not in logged[1]


def test_names_that_could_break_a_header_are_encoded_and_capped(http):
    odd = {"a\r\nSet-Cookie: x": 1, "ü": 2, **{f"k{i}": i for i in range(30)}}
    r = chat(http, **odd)
    assert r.status_code == 200
    value = r.headers[IGNORED_FIELDS_HEADER]
    assert "\r" not in value and "\n" not in value
    assert value.startswith("a%0D%0ASet-Cookie%3A%20x, %C3%BC, k0")
    assert value.endswith("(+16 more)")


def test_strict_fields_refuses_unknown_names(tools_tokenizer_dir):
    http, engine = inproc(tools_tokenizer_dir, strict_fields=True)
    messages = [{**MESSAGES[0], "cache_control": 1}]
    r = http.post(CHAT, json={"model": MODEL, "messages": messages, "foo": 1})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"] == "unknown field(s): foo, messages.0.cache_control"
    assert error["param"] == "foo"
    assert chat(http, user="known, so accepted").status_code == 200
    assert len(engine.opened) == 1


REFUSED = [
    (COMPLETIONS, "suffix", "end", "not supported"),
    (COMPLETIONS, "use_beam_search", True, "beam search"),
    (COMPLETIONS, "truncate_prompt_tokens", 5, "truncation"),
    (CHAT, "functions", [{"name": "f"}], "send tools"),
    (CHAT, "function_call", "auto", "send tool_choice"),
    (CHAT, "audio", {"voice": "x"}, "audio"),
    (CHAT, "web_search_options", {}, None),  # empty: unused, so accepted
    (CHAT, "chat_template", "{{ 7 * 7 }}", "own chat template"),
    (CHAT, "echo", True, "not supported"),
]


@pytest.mark.parametrize(
    "path, name, value, words", REFUSED, ids=[f"{r[0]}-{r[1]}" for r in REFUSED]
)
def test_known_fields_that_cannot_be_honoured_are_refused_by_name(app, path, name, value, words):
    http, engine = app
    before = len(engine.opened)
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    r = http.post(path, json={"model": MODEL, **base, "max_tokens": 3, name: value})
    if words is None:  # the field's "not used" value
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and error["message"].startswith(f"{name}: ")
    assert words in error["message"]
    assert len(engine.opened) == before  # never reached the engine


def test_extensions_reach_the_engine_as_token_ids(app, tools_tokenizer_dir):
    http, engine = app
    tok = Tokenizer(tools_tokenizer_dir)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    body.update(logit_bias={"5": 10, "007": -1.5}, allowed_token_ids=[5, 7, 9], prompt_logprobs=2)
    body["bad_words"] = ["weather"]
    assert http.post(COMPLETIONS, json=body).status_code == 200
    params = engine.opened[-1][1]
    assert params["logit_bias"] == ((5, 10.0), (7, -1.5))
    assert params["allowed_token_ids"] == (5, 7, 9) and params["prompt_logprobs"] == 2
    words = {tuple(tok.encode(w, add_special_tokens=False)) for w in ("weather", " weather")}
    assert set(params["bad_words"]) == words


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "fields, kind, spec",
    [
        ({"response_format": {"type": "json_object"}}, "json", {"type": "object"}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "m", "schema": SCHEMA, "strict": True},
                }
            },
            "json",
            SCHEMA,
        ),  # fmt: skip
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "m"}}}, "json", {}),
        ({"guided_json": SCHEMA}, "json", SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, "json", SCHEMA),
        ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"guided_choice": ["up", 'say "hi"']}, "ebnf", 'root ::= "up" | "say \\"hi\\""'),
        ({"guided_grammar": 'root ::= "a"'}, "ebnf", 'root ::= "a"'),
        ({"guided_grammar": 'start: "a"'}, "lark", 'start: "a"'),
        ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
        ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "regex", "a+"),
        ({"structured_outputs": {"json_object": True}}, "json", {"type": "object"}),
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_each_way_of_constraining_the_output_reaches_the_engine_as_one_grammar(
    app, path, fields, kind, spec
):
    http, engine = app
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    r = http.post(path, json={"model": MODEL, **base, "max_tokens": 3, **fields})
    assert r.status_code == 200, r.text
    grammar = engine.opened[-1][1]["structured_output"]
    assert grammar["kind"] == kind
    assert (json.loads(grammar["spec"]) if kind == "json" else grammar["spec"]) == spec


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema: required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            'response_format: the grammar does not compile: Unsupported type "x"',
        ),
        ({"guided_json": "{"}, "guided_json: not valid JSON"),
        ({"guided_json": "[1]"}, "guided_json: a JSON schema must be an object"),
        ({"guided_regex": "a("}, "guided_regex: the grammar does not compile: Regex parsing"),
        ({"guided_regex": ""}, "guided_regex: must be a non-empty"),
        ({"guided_choice": []}, "guided_choice: must be a non-empty list"),
        ({"guided_grammar": "root ::= x"}, 'column 10: Rule "x" is not defined'),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structural tags are not supported"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "only one way"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "only one way"),
        ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos: cannot be combined"),
        ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens: cannot be combined"),
        ({"guided_regex": "a+", "allowed_token_ids": [5]}, "allowed_token_ids: cannot be"),
        ({"guided_regex": "a+", "bad_words": ["x"]}, "bad_words: cannot be combined"),
        ({"logit_bias": {"x": 1}}, "logit_bias: keys must be token ids, got 'x'"),
        ({"logit_bias": {"5": 101}}, "logit_bias: must be in [-100.0, 100.0], got 101"),
        ({"logit_bias": {"99999": 1}}, "logit_bias: token ids must be in [0, "),
        ({"logit_bias": {"5": "high"}}, "logit_bias.5"),
        ({"allowed_token_ids": []}, "allowed_token_ids: must hold 1 to"),
        ({"allowed_token_ids": [99999]}, "allowed_token_ids: ids must be in [0, "),
        ({"bad_words": [" "]}, "bad_words: each must be a non-empty word"),
        ({"prompt_logprobs": 9}, "prompt_logprobs: must be in [0, 5], got 9"),
        ({"max_tokens": 0}, "max_tokens: must be at least 1 (0 only with echo)"),
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bad_extension_values_are_400_naming_the_field(app, path, fields, words):
    http, engine = app
    before = len(engine.opened)
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    r = http.post(path, json={"model": MODEL, **base, **fields})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert len(engine.opened) == before  # never reached the engine


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": "y"}}, "stream_options"),
        ({"top_k": -2}, "top_k: must be -1 or 0 (off)"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tool_choice": "sometimes"}, "tool_choice: must be"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages: set by"),
        ({"add_generation_prompt": True, "continue_final_message": True}, "cannot be combined"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
        ({"messages": [{"role": "user"}]}, "messages.0.content: required"),
    ],
)
def test_bad_values_of_known_fields_are_400_naming_the_field(app, fields, words):
    http, engine = app
    before = len(engine.opened)
    r = chat(http, **fields)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert len(engine.opened) == before


def _documented_fields() -> set[str]:
    text = DOCS.read_text()
    table = text[text.index("### Request fields") :]
    table = table[: table.index("\n\n", table.index("|---"))]
    first_cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    return {name for cell in first_cells for name in re.findall(r"`([^`]+)`", cell)}


def test_the_field_table_in_the_docs_lists_every_request_field():
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    fields |= {f"messages[].{name}" for name in ChatMessage.model_fields}
    fields |= {f"stream_options.{name}" for name in StreamOptions.model_fields}
    documented = _documented_fields()
    assert fields - documented == set(), "fields missing from docs/serving.md"
    assert documented - fields == set(), "docs/serving.md lists fields the server lacks"


def test_a_schema_keyword_the_grammar_would_not_enforce_is_400(http):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    r = chat(http, guided_json=schema)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message == "guided_json: the schema uses uniqueItems, which xgrammar does not enforce"
