"""The Responses API over HTTP (no Ray), through the official ``openai`` client, every
body and event validated by the client's own pydantic models.

The echo engine's output is the last user message, so each test writes the
"model's" output: text, ``<think>`` blocks (the server runs the qwen3 reasoning
parser), ``<tool_call>`` blocks (the hermes parser).
"""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from iterserve.cluster.openai.responses.items import chat_body, from_stored, own_items
from iterserve.cluster.openai.responses.protocol import ResponsesRequest
from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import MODEL, inproc
from tests.serve.echo import build_tools_tokenizer

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("responses") / "tiny-think"
    return build_tools_tokenizer(path, extra_special=("<think>", "</think>"))


@pytest.fixture(scope="module")
def app(think_dir):
    return inproc(think_dir, tool_call_parser="hermes", reasoning_parser="qwen3")


@pytest.fixture(scope="module")
def tok(think_dir):
    return Tokenizer(think_dir)


def create(http, **body) -> dict:
    """POST /v1/responses; the body validated as the client's Response."""
    r = http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    return r.json()


def stream_events(http, **body) -> list[dict]:
    """The stream's events, each validated; the SSE event name is its type."""
    events = []
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == name
                EVENT.validate_python(event)
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def last_prompt(app, tok) -> str:
    return tok.decode(app[1].opened[-1][0], skip_special_tokens=False)


def refusal(http, **body) -> dict:
    r = http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_a_text_input_answers_one_message_with_usage(client, app, tok):
    r = client.responses.create(model=MODEL, input="hello world", instructions="be brief")
    assert r.status == "completed" and r.output_text == "hello world"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.instructions == "be brief" and r.id.startswith("resp_")
    assert r.usage.input_tokens == len(app[1].opened[-1][0])
    assert r.usage.output_tokens == len(tok.encode("hello world", False)) + 1  # and EOS
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    prompt = last_prompt(app, tok)
    assert prompt.index("<|system|>be brief") < prompt.index("<|user|>hello world")


def test_input_items_are_the_conversation(http, app, tok):
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
        {"role": "user", "content": "hello world"},
    ]
    assert create(http, input=items)["output"][0]["content"][0]["text"] == "hello world"
    prompt = last_prompt(app, tok)
    assert "<|system|>rules<|end|><|user|>hi<|end|><|assistant|>yo<|end|><|user|>hello" in prompt


def test_the_stream_is_the_typed_event_sequence(http):
    events = stream_events(http, input="<think>plan it</think>hello world")
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    reasoning = [e for e in events if e.get("output_index") == 0]
    assert [e["type"] for e in reasoning][0] == "response.output_item.added"
    assert reasoning[0]["item"]["type"] == "reasoning"
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == (
        "plan it"
    )
    message = [e["type"] for e in events if e.get("output_index") == 1]
    assert message[:2] == ["response.output_item.added", "response.content_part.added"]
    assert message[-3:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "hello world"
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "plan it"}]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_the_client_stream_helper_assembles_the_response(client):
    with client.responses.stream(model=MODEL, input="hello world") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "hello world"
    assert client.responses.retrieve(final.id).output_text == "hello world"


def test_function_calls_and_their_outputs(client, app, tok):
    r = client.responses.create(model=MODEL, input=f"Checking.{CALL}", tools=[WEATHER])
    message, call = r.output
    assert message.content[0].text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    prompt = last_prompt(app, tok)
    assert '"name": "get_weather"' in prompt  # the tool, rendered by the chat template
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, input=[answer], tools=[WEATHER]
    )
    assert follow.previous_response_id == r.id
    prompt = last_prompt(app, tok)
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    )
    assert "<|tool|><tool_response>sunny</tool_response>" in prompt


def test_a_streamed_call_comes_in_its_own_item(http):
    events = stream_events(http, input=CALL, tools=[WEATHER])
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"]) == {"city": "Paris"}
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["function_call"]


def test_required_and_named_tool_choices_constrain_the_answer(http, app):
    calls = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    body = create(http, input=calls, tools=[WEATHER], tool_choice="required")
    assert [item["type"] for item in body["output"]] == ["function_call"]
    assert app[1].opened[-1][1]["structured_output"]["kind"] == "json"
    named = {"type": "function", "name": "get_weather"}
    body = create(http, input='{"city": "Paris"}', tools=[WEATHER], tool_choice=named)
    assert body["output"][0]["name"] == "get_weather" and body["tool_choice"] == named


def test_text_format_is_structured_output(http, app):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    form = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    body = create(http, input='{"city": "Paris"}', text={"format": form})
    assert body["text"]["format"]["name"] == "place"
    spec = app[1].opened[-1][1]["structured_output"]
    assert spec["kind"] == "json" and json.loads(spec["spec"]) == schema
    create(http, input="{}", text={"format": {"type": "json_object"}})
    assert app[1].opened[-1][1]["structured_output"]["spec"] == '{"type": "object"}'
    error = refusal(http, input="x", text={"format": {"type": "json_schema", "schema": schema}})
    assert error["param"] == "text.format.name"
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}
    assert refusal(http, input="x", text={"format": bad})["param"] == "text.format"


def test_previous_response_id_continues_without_the_old_instructions(client, app, tok):
    first = client.responses.create(model=MODEL, input="hello world", instructions="old rules")
    client.responses.create(model=MODEL, input="nice weather", previous_response_id=first.id,
                            instructions="new rules")  # fmt: skip
    prompt = last_prompt(app, tok)
    assert "old rules" not in prompt and "<|system|>new rules" in prompt
    turns = "<|user|>hello world<|end|><|assistant|>hello world<|end|><|user|>nice weather"
    assert turns in prompt
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")
    assert info.value.body["param"] == "previous_response_id"


def test_stored_responses_are_read_and_deleted(client):
    kept = client.responses.create(model=MODEL, input="hello world")
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    client.responses.delete(kept.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(kept.id)
    unkept = client.responses.create(model=MODEL, input="hello world", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_max_output_tokens_leaves_the_response_incomplete(http):
    body = create(http, input="hello world", max_output_tokens=2)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 2
    events = stream_events(http, input="hello world", max_output_tokens=2)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"


def test_reasoning_items_reach_the_template_with_the_answer_they_led_to(http):
    first = create(http, input="<think>because</think>hello world")
    assert [item["type"] for item in first["output"]] == ["reasoning", "message"]
    request = ResponsesRequest.model_validate({"input": "nice weather"})
    history = from_stored(first["output"])
    body = chat_body(request, history, own_items(request), MODEL)
    assert body["messages"][0] == {
        "role": "assistant",
        "content": "hello world",
        "reasoning_content": "because",
    }
    error = refusal(http, input=[{"type": "reasoning", "summary": [], "encrypted_content": "xyz"}])
    assert error["param"] == "input.0.encrypted_content"


def test_function_calls_join_the_assistant_message_before_them():
    items = [
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call", "call_id": "c3", "name": "h", "arguments": "{}"},
    ]
    request = ResponsesRequest.model_validate({"input": items, "instructions": "sys"})
    messages = chat_body(request, [], own_items(request), MODEL)["messages"]
    assert [(m["role"], len(m.get("tool_calls", []))) for m in messages] == [
        ("system", 0), ("assistant", 2), ("tool", 0), ("assistant", 1),
    ]  # fmt: skip
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "one"}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
         "input.0.arguments"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused_by_name(http, fields, param):
    body = {"input": "hello world", **fields}
    assert refusal(http, **body)["param"] == param


def test_an_input_past_the_context_names_the_input(http):
    error = refusal(http, input="hello world " * 600)
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert "in the input" in error["message"]


def test_the_client_parse_helper_reads_structured_output(client, app):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        population: int

    r = client.responses.parse(
        model=MODEL, input='{"name": "Paris", "population": 2100000}', text_format=City
    )
    assert r.output_parsed == City(name="Paris", population=2100000)
    assert app[1].opened[-1][1]["structured_output"]["kind"] == "json"
