"""The clients people point at OpenAI-compatible servers, against the real server.

The app runs the echo executor (tests/serve/echo.py): the "model" answers with the
last user message, so a test makes it call a tool by writing the call. The server
reads calls with the hermes parser and allows one browser origin.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import API_KEY, AUTH, assert_engines_sound, deploy, undeploy
from tests.serve.conftest import wait_idle as _wait_idle
from tests.serve.echo import echo_engine

APP = "clients"
MODEL = "tiny-tools"  # the tokenizer directory's name
ORIGIN = "https://app.example"
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def url(serve_url, tools_tokenizer_dir):
    yield deploy(
        serve_url,
        APP,
        model=str(tools_tokenizer_dir),
        config=echo_engine(tools_tokenizer_dir),
        api_key=API_KEY,
        tool_call_parser="hermes",
        cors_allowed_origins=[ORIGIN],
    )
    undeploy(APP)


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def chat_model(url):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=f"{url}/v1", api_key=API_KEY, model=MODEL, max_retries=0, temperature=0
    )


WEATHER_TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's shape


def say(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_openai_tools_with_auto_choice_come_back_as_tool_calls(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=say(f"Checking.{CALL}"), tools=[WEATHER], tool_choice="auto"
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    plain = client.chat.completions.create(model=MODEL, messages=say("Sunny."), tools=[WEATHER])
    assert plain.choices[0].message.content == "Sunny." and not plain.choices[0].message.tool_calls


def test_openai_tool_choice_none_required_and_named(client):
    none = client.chat.completions.create(
        model=MODEL, messages=say(CALL), tools=[WEATHER], tool_choice="none"
    )
    assert none.choices[0].message.content == CALL and none.choices[0].finish_reason == "stop"
    # required and a named function constrain the output to calls; the echo "model"
    # writes what the user wrote, which here is such a call.
    calls = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    required = client.chat.completions.create(
        model=MODEL, messages=say(calls), tools=[WEATHER], tool_choice="required"
    )
    named = client.chat.completions.create(
        model=MODEL,
        messages=say('{"city": "Paris"}'),
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    for reply in (required, named):
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_openai_streams_tool_calls_as_deltas(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=say(f"One moment.{CALL}"), tools=[WEATHER], stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "One moment."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_openai_sends_vllm_fields_and_unknown_ones_in_extra_body(client):
    extra = {"skip_special_tokens": False, "include_stop_str_in_output": True, "top_k": -1}
    extra["some_future_option"] = {"x": 1}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=say("hello world"), stop=["world"], extra_body=extra
    )
    assert raw.headers["x-iterserve-ignored-fields"] == "some_future_option"
    assert raw.parse().choices[0].message.content == "hello world"


def test_openai_streams_with_continuous_usage_stats(client):
    # What a widely used benchmark tool sends on every request.
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=say("hello world"), stream=True, stream_options=options
        )
    )
    assert all(c.usage is not None for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 2


class City(BaseModel):
    name: str
    population: int


CITY = '{"name": "Paris", "population": 2100000}'


def test_openai_parse_with_a_pydantic_model_and_json_object(client):
    parsed = client.chat.completions.parse(model=MODEL, messages=say(CITY), response_format=City)
    assert parsed.choices[0].message.parsed == City(name="Paris", population=2100000)
    reply = client.chat.completions.create(
        model=MODEL, messages=say('{"ok": true}'), response_format={"type": "json_object"}
    )
    assert json.loads(reply.choices[0].message.content) == {"ok": True}
    with pytest.raises(openai.BadRequestError, match="does not compile") as info:
        client.chat.completions.create(
            model=MODEL,
            messages=say("hi"),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            },
        )
    assert info.value.body["param"] == "response_format"


def test_openai_echo_with_logprobs_and_max_tokens_zero(client, tools_tokenizer_dir):
    prompt = "<|user|>hello world<|end|>"
    reply = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0
    )
    (choice,) = reply.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    tok = Tokenizer(tools_tokenizer_dir)
    ids = tok.encode(prompt)
    assert choice.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(
        ids
    )
    assert reply.usage.completion_tokens == 0
    more = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=20)
    assert more.choices[0].text == prompt + "hello world"


def test_openai_responses_read_calls_as_chat_does(client):
    # More of the Responses API: tests/serve/test_responses*.py.
    reply = client.responses.create(model=MODEL, input=f"Checking.{CALL}", tools=[WEATHER_TOOL])
    assert [item.type for item in reply.output] == ["message", "function_call"]
    assert reply.output_text == "Checking." and reply.output[1].name == "get_weather"


def test_langchain_invoke_and_stream(chat_model):
    assert chat_model.invoke("hello world").content == "hello world"
    chunks = list(chat_model.stream("hello there"))
    assert "".join(c.content for c in chunks) == "hello there"


def test_langchain_bind_tools_reads_the_call(chat_model):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    with_tools = chat_model.bind_tools([get_weather])
    message = with_tools.invoke(CALL)
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    total = None
    for chunk in with_tools.stream(CALL):
        total = chunk if total is None else total + chunk
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method):
    # json_schema sends response_format; function_calling sends the model as a tool
    # and names it in tool_choice. Either way the reply is parsed into the model.
    structured = chat_model.with_structured_output(City, method=method)
    assert structured.invoke(CITY) == City(name="Paris", population=2100000)


def test_tokenize_and_a_cors_preflight_through_the_proxy(url):
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "hello"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["count"] >= 1
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert httpx.get(f"{url}/version", headers=AUTH).json()["version"]


def test_version_shows_how_the_server_runs(url):
    body = httpx.get(f"{url}/version", headers=AUTH).json()
    assert body["prefix_caching"] is True and body["routing"] == "prefix"
    assert body["engine_replicas"] == 1 and body["policy"] and body["max_num_seqs"] >= 1


async def test_no_request_left_anything_behind(url):
    async with httpx.AsyncClient(base_url=url, headers=AUTH) as client:
        stats = await _wait_idle(client)
    assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0
    await assert_engines_sound(APP)
