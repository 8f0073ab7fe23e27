"""Tool calling over HTTP (no Ray): tools rendered by the template, calls parsed
from the output whole and streamed, tool_choice modes, tool history.

The echo engine's output is the last user message, so each test writes the
"model's" reply itself.
"""

from __future__ import annotations

import json

import pytest

from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import MODEL, inproc, sse_events
from tests.serve.echo import build_tools_tokenizer

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def app(tools_tokenizer_dir):
    return inproc(tools_tokenizer_dir, tool_call_parser="hermes")


@pytest.fixture
def http(app):
    return app[0]


@pytest.fixture(scope="module")
def tok(tools_tokenizer_dir):
    return Tokenizer(tools_tokenizer_dir)


def ask(http, reply: str, tools=(WEATHER,), **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": reply}], **fields}
    if tools is not None:
        body["tools"] = list(tools)
    return http.post(CHAT, json=body)


def stream(http, reply: str, tools=(WEATHER,), **fields) -> list[dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": reply}], "stream": True}
    body.update(tools=list(tools), **fields)
    with http.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def test_tools_are_rendered_into_the_prompt_by_the_chat_template(app, tok):
    assert ask(app[0], "hi", tool_choice="none").status_code == 200
    prompt = tok.decode(app[1].opened[-1][0], skip_special_tokens=False)
    assert f"<tools>{json.dumps(WEATHER)}\n</tools>" in prompt


def test_auto_reads_a_call_out_of_the_reply(http):
    r = ask(http, f"Let me check.\n{CALL}")
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check.\n"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_reply_that_is_only_a_call_has_null_content(http):
    message = ask(http, CALL).json()["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1


def test_auto_leaves_a_plain_reply_as_content(http):
    (choice,) = ask(http, "It is sunny.").json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."}
    assert choice["finish_reason"] == "stop"


def test_a_streamed_call_arrives_as_a_tool_calls_delta(http):
    events = stream(http, f"Checking.{CALL}")
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any("<tool_call>" in (d.get("content") or "") for d in deltas)


def test_streamed_and_whole_answers_agree_on_several_calls(http):
    second = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    reply = f"{CALL}\n{second}"
    whole = ask(http, reply, tools=(WEATHER, TIME)).json()["choices"][0]["message"]["tool_calls"]
    events = stream(http, reply, tools=(WEATHER, TIME))
    streamed = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["index"] for c in streamed] == [0, 1]
    assert [c["function"] for c in streamed] == [c["function"] for c in whole]


def test_parallel_tool_calls_false_keeps_the_first_call(http):
    second = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    r = ask(http, CALL + second, tools=(WEATHER, TIME), parallel_tool_calls=False)
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_tool_choice_none_offers_the_tools_but_reads_no_calls(http):
    (choice,) = ask(http, CALL, tool_choice="none").json()["choices"]
    assert choice["message"]["content"] == CALL and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_each_of_n_choices_is_read_on_its_own(http):
    choices = ask(http, CALL, n=2).json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["tool_calls", "tool_calls"]
    ids = {c["message"]["tool_calls"][0]["id"] for c in choices}
    assert len(ids) == 2


def grammar_of(engine) -> dict:
    spec = engine.opened[-1][1]["structured_output"]
    assert spec["kind"] == "json"
    return json.loads(spec["spec"])


def test_required_constrains_the_output_to_a_list_of_calls_and_reads_them(app):
    http, engine = app
    reply = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}},
                        {"name": "get_time", "parameters": {}}])  # fmt: skip
    r = ask(http, reply, tools=(WEATHER, TIME), tool_choice="required")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in choice["message"]["tool_calls"]]  # fmt: skip
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    schema = grammar_of(engine)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert (
        schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    )
    ask(http, reply, tools=(WEATHER, TIME), tool_choice="required", parallel_tool_calls=False)
    assert grammar_of(engine)["maxItems"] == 1


def test_a_named_function_constrains_the_output_to_its_arguments(app):
    http, engine = app
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = ask(http, '{"city": "Paris"}', tools=(WEATHER, TIME), tool_choice=named)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert grammar_of(engine) == WEATHER["function"]["parameters"]
    events = stream(http, '{"city": "Rome"}', tools=(WEATHER,), tool_choice=named)
    (delta,) = [
        e["choices"][0]["delta"] for e in events if e["choices"][0]["delta"].get("tool_calls")
    ]
    assert json.loads(delta["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}


@pytest.mark.parametrize(
    "fields, words",
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which is not among the tools",
        ),
        ({"tools": None, "tool_choice": "auto"}, "tool_choice: needs tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice: needs tools"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "only one way of constraining the output",
        ),
    ],
)
def test_tool_choices_that_cannot_be_served_are_400(app, fields, words):
    http, engine = app
    before = len(engine.opened)
    tools = fields.pop("tools", (WEATHER,))
    r = ask(http, "hi", tools=tools, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tool_choice" and words in error["message"]
    assert len(engine.opened) == before


def test_auto_needs_a_parser_on_the_server(tools_tokenizer_dir):
    http, _ = inproc(tools_tokenizer_dir)  # no tool_call_parser
    r = ask(http, CALL)
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
    assert ask(http, CALL, tool_choice="none").status_code == 200


def test_tool_calls_and_results_in_the_history_go_through_the_template(app, tok):
    http = app[0]
    arguments = json.dumps({"city": "Paris"})
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "Thanks"},
    ]
    r = http.post(CHAT, json={"model": MODEL, "messages": history, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Thanks"
    prompt = tok.decode(app[1].opened[-1][0], skip_special_tokens=False)
    # The arguments reach the template as an object, which it writes as JSON again.
    assert (
        '<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "</tool_call><|end|><|tool|><tool_response>sunny</tool_response><|end|>"
    ) in prompt


@pytest.mark.parametrize("arguments, words", [("{oops", "not valid JSON"), ("[1]", "JSON object")])
def test_bad_arguments_in_the_history_are_400_naming_them(http, arguments, words):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [{"role": "assistant", "tool_calls": [call]}, {"role": "user", "content": "x"}]
    r = http.post(CHAT, json={"model": MODEL, "messages": messages})
    error = r.json()["error"]
    assert r.status_code == 400 and words in error["message"]
    assert error["param"] == "messages.0.tool_calls.0.function.arguments"


def test_the_llama3_json_parser_reads_a_json_reply(tools_tokenizer_dir):
    http, _ = inproc(tools_tokenizer_dir, tool_call_parser="llama3_json")
    reply = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    (choice,) = ask(http, reply).json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris"
    }
    assert ask(http, "Just words.").json()["choices"][0]["message"]["content"] == "Just words."


def test_tags_the_tokenizer_counts_as_special_are_kept_for_the_parser(tmp_path):
    # Some tokenizers (Qwen's among them) make <tool_call> a special token, which
    # skip_special_tokens would otherwise drop before the parser sees it.
    path = build_tools_tokenizer(tmp_path / "special-tags", ("<tool_call>", "</tool_call>"))
    assert "<tool_call>" in Tokenizer(path).special_tokens
    http, _ = inproc(path, tool_call_parser="hermes")
    message = ask(http, CALL).json()["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1


def test_the_demo_models_template_takes_a_tool_history():
    # Its template knows no tools: it writes every role as <|role|> and content as
    # text, so a tool turn and an assistant's call (content null) must still render.
    from iterserve.models import DEMO_MODEL_PATH

    http, engine = inproc(DEMO_MODEL_PATH)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = {"model": MODEL, "messages": history, "tools": [WEATHER], "tool_choice": "none"}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    prompt = Tokenizer(DEMO_MODEL_PATH).decode(engine.opened[-1][0], skip_special_tokens=False)
    assert prompt.endswith("<|assistant|>\n\n<|tool|>\nsunny\n<|assistant|>\n")


def _cut_inside_the_second_call(tok, reply: str) -> int:
    """A max_tokens that ends the reply inside its second call's JSON."""
    ids = tok.encode(reply, add_special_tokens=False)
    first_end = reply.index("}}") + 2
    for n in range(1, len(ids)):
        text = tok.decode(ids[:n])
        if len(text) > first_end + 12:
            return n
    raise AssertionError("reply too short")


def test_required_calls_cut_by_max_tokens_are_kept_and_the_answer_says_length(app, tok):
    http, _ = app
    reply = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}},
                        {"name": "get_time", "parameters": {"zone": "UTC"}}])  # fmt: skip
    max_tokens = _cut_inside_the_second_call(tok, reply)
    fields = dict(tools=(WEATHER, TIME), tool_choice="required", max_tokens=max_tokens)
    r = ask(http, reply, **fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    events = stream(http, reply, **fields)
    deltas = [e["choices"][0] for e in events if e["choices"]]
    streamed = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in streamed] == ["get_weather"]
    assert not any(d["delta"].get("content") for d in deltas)
    assert deltas[-1]["finish_reason"] == "length"
