"""Requests carry only what the caller gave; answers parse into typed results."""

from __future__ import annotations

import pytest
from iterserve_client import (
    ChatCompletion,
    ChatMessage,
    Completion,
    EngineStats,
    Health,
    Model,
    NotFoundError,
)

from tests.client.stub import error_reply, json_reply
from tests.client.util import resolve

COMPLETION = {
    "id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
    "choices": [{"index": 0, "text": " world", "finish_reason": "length", "new_field": 1,
                 "logprobs": {"tokens": [" world"], "token_logprobs": [-0.1],
                              "top_logprobs": [{" world": -0.1}], "text_offset": [0]}}],
    "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
    "system_fingerprint": None, "unknown": {"nested": True},
}  # fmt: skip
CHAT = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 5, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi!"},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
}  # fmt: skip
ENGINE = {"policy": "chunked", "num_running": 2, "num_waiting": 1, "slots_used": 2,
          "slots_total": 8, "kv_blocks_used": 10, "kv_blocks_total": 40, "kv_usage": 0.25,
          "step": 9, "counters": {"finished": 3}}  # fmt: skip


async def test_completion_sends_only_given_arguments(make_client, stub):
    stub.add(json_reply(200, COMPLETION))
    out = await resolve(
        make_client(api_key="secret").completions.create(
            model="m",
            prompt="hello",
            max_tokens=1,
            temperature=0.0,
            top_k=None,
            logprobs=1,
            priority=-1,
            custom_field="x",
        )
    )
    sent = stub.requests[0]
    assert (sent.method, sent.path) == ("POST", "/v1/completions")
    assert sent.body == {"model": "m", "prompt": "hello", "max_tokens": 1, "temperature": 0.0,
                         "logprobs": 1, "priority": -1, "custom_field": "x"}  # fmt: skip
    assert sent.headers["authorization"] == "Bearer secret"
    assert isinstance(out, Completion)
    assert out.choices[0].text == " world" and out.usage.total_tokens == 3
    assert out.choices[0].logprobs.token_logprobs == [-0.1]
    assert out.raw["unknown"] == {"nested": True}


async def test_chat_accepts_dicts_and_messages(make_client, stub):
    stub.add(json_reply(200, CHAT))
    messages = [ChatMessage(role="system", content="Be brief."), {"role": "user", "content": "Hi"}]
    out = await resolve(
        make_client().chat.completions.create(model="m", messages=messages, logprobs=False)
    )
    sent = stub.requests[0]
    assert sent.path == "/v1/chat/completions"
    assert sent.body == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "logprobs": False,
    }
    assert isinstance(out, ChatCompletion)
    assert out.choices[0].message == ChatMessage(role="assistant", content="Hi!")
    assert out.choices[0].finish_reason == "stop" and out.choices[0].logprobs is None


async def test_tool_calls_come_back_on_the_message_and_go_out_in_the_history(make_client, stub):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    reply = {**CHAT, "choices": [{"index": 0, "finish_reason": "tool_calls",
                                  "message": {"role": "assistant", "content": None,
                                              "tool_calls": [call]}}]}  # fmt: skip
    stub.add(json_reply(200, reply), json_reply(200, CHAT))
    client = make_client()
    out = await resolve(client.chat.completions.create(model="m", messages=[], tools=[]))
    message = out.choices[0].message
    assert message.tool_calls == [call] and out.choices[0].finish_reason == "tool_calls"
    answer = ChatMessage(role="tool", content="sunny", tool_call_id="call_1")
    await resolve(client.chat.completions.create(model="m", messages=[message, answer]))
    assert stub.requests[1].body["messages"] == [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]


async def test_base_url_with_v1_suffix(make_client, stub):
    stub.add(json_reply(200, {"object": "list", "data": [{"id": "m", "object": "model"}]}))
    models = await resolve(make_client(stub.url + "/v1/").models())
    assert stub.requests[0].path == "/v1/models"
    assert models == [Model(id="m", object="model", created=0, owned_by="")]


async def test_health_healthy_and_unhealthy(make_client, stub):
    stub.add(json_reply(200, {"status": "ok"}),
             error_reply(503, "engine 0: worker lost", retry_after="0"))  # fmt: skip
    client = make_client(max_retries=3)
    healthy = await resolve(client.health())
    unhealthy = await resolve(client.health())
    assert isinstance(healthy, Health) and healthy and healthy.status_code == 200
    assert not unhealthy and unhealthy.status_code == 503
    assert unhealthy.message == "engine 0: worker lost"
    assert len(stub.requests) == 2  # an unhealthy answer is an answer: not retried


async def test_health_raises_for_other_failures(make_client, stub):
    stub.add(error_reply(404, "no such route"))
    with pytest.raises(NotFoundError):
        await resolve(make_client().health())


async def test_stats_of_one_engine(make_client, stub):
    stub.add(json_reply(200, ENGINE))
    stats = await resolve(make_client().stats())
    assert stub.requests[0].path == "/v1/stats"
    assert isinstance(stats, EngineStats)
    assert (stats.num_running, stats.num_waiting, stats.policy) == (2, 1, "chunked")
    assert stats.slot_utilization == 0.25
    assert (stats.kv_blocks_used, stats.kv_blocks_total, stats.kv_usage) == (10, 40, 0.25)
    assert stats.raw["step"] == 9


async def test_stats_of_several_engines_are_summed(make_client, stub):
    idle = {**ENGINE, "num_running": 0, "num_waiting": 0, "slots_used": 0, "kv_blocks_used": 0,
            "kv_usage": 0.0}  # fmt: skip
    stub.add(json_reply(200, {"engines": [ENGINE, idle], "num_replicas": 2}))
    stats = await resolve(make_client().stats())
    assert (stats.num_running, stats.slots_used, stats.slots_total) == (2, 2, 16)
    assert stats.slot_utilization == 2 / 16
    assert stats.kv_usage == 10 / 80
    assert stats.policy == "chunked"
    assert len(stats.engines) == 2 and stats.engines[1].num_running == 0


def test_stats_tolerate_odd_answers():
    assert EngineStats.from_dict([ENGINE]).slots_total == 8
    assert EngineStats.from_dict({}).slot_utilization == 0.0
    mixed = EngineStats.from_dict({"engines": [ENGINE, {**ENGINE, "policy": "fcfs"}]})
    assert mixed.policy == "chunked,fcfs"


def test_stats_already_summed_with_replicas():
    summed = {**ENGINE, "slots_total": 16, "policy": ["chunked", "fcfs"],
              "replicas": [ENGINE, {**ENGINE, "policy": "fcfs"}]}  # fmt: skip
    stats = EngineStats.from_dict(summed)
    assert stats.slots_total == 16 and stats.policy == "chunked,fcfs"
    assert [e.policy for e in stats.engines] == ["chunked", "fcfs"]
