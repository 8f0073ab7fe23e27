"""The Responses API and reasoning output on the real server (Ray Serve, the engine
channel, the stored responses' actor), through the official ``openai`` client.

The app runs the echo executor (tests/serve/echo.py): the "model" answers with the
last user message. The server reads calls with the hermes parser and reasoning
with the qwen3 parser; the tokenizer has ``<think>`` and ``</think>`` tokens.
"""

from __future__ import annotations

import json

import openai
import pytest
import ray
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from iterserve.cluster.openai.responses.store import STORE_NAMESPACE, store_name
from tests.serve.conftest import API_KEY, assert_engines_sound, deploy, undeploy
from tests.serve.conftest import wait_idle as _wait_idle
from tests.serve.echo import build_tools_tokenizer, echo_engine

APP = "responses"
MODEL = "tiny-think"  # the tokenizer directory's name
EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def url(serve_url, tmp_path_factory):
    path = tmp_path_factory.mktemp("responses-server") / MODEL
    build_tools_tokenizer(path, extra_special=("<think>", "</think>"))
    config = echo_engine(path, reasoning_parser="qwen3")
    yield deploy(
        serve_url, APP, model=str(path), config=config, api_key=API_KEY, tool_call_parser="hermes"
    )
    undeploy(APP)


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


def test_responses_create_and_retrieve_validate_as_the_clients_types(client):
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="<think>short one</think>hello world", instructions="be brief"
    )
    body = Response.model_validate(json.loads(raw.text))
    assert body.output_text == "hello world" and body.status == "completed"
    assert [item.type for item in body.output] == ["reasoning", "message"]
    assert body.output[0].content[0].text == "short one"
    assert body.usage.output_tokens_details.reasoning_tokens > 0
    again = client.responses.with_raw_response.retrieve(body.id)
    assert Response.model_validate(json.loads(again.text)) == body


def test_responses_stream_events_validate_in_order(client):
    events = []
    with client.responses.stream(model=MODEL, input=f"<think>call it</think>{CALL}",
                                 tools=[WEATHER]) as stream:  # fmt: skip
        for event in stream:
            events.append(EVENT.validate_python(event.to_dict()))
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_a_function_call_round_trip_through_the_shared_store(client):
    first = client.responses.create(model=MODEL, input=f"Checking.{CALL}", tools=[WEATHER])
    call = next(item for item in first.output if item.type == "function_call")
    # Stored in the one actor every ingress replica of this model reads.
    store = ray.get_actor(store_name(MODEL), namespace=STORE_NAMESPACE)
    assert ray.get(store.get.remote(first.id)) is not None
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    follow = client.responses.create(
        model=MODEL, input=[answer], previous_response_id=first.id, tools=[WEATHER],
        tool_choice="none",
    )  # fmt: skip
    assert follow.status == "completed" and follow.previous_response_id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_responses_refuse_what_they_cannot_honour_by_name(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", background=True)
    assert info.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools.0.type"


def test_chat_reasoning_through_the_openai_client(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "<think>why</think>\n\nhello world"}]
    )
    message = reply.choices[0].message
    assert message.content == "hello world"
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == "why"
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "<think>why</think>hello world"}],
        stream=True,
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == "why"
    assert "".join(d.content or "" for d in deltas) == "hello world"


async def test_the_engine_is_idle_and_sound_after(url):
    import httpx

    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=30) as http:  # fmt: skip
        stats = await _wait_idle(http)
    assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0
    await assert_engines_sound(APP)
