"""Every refusal is a 4xx in OpenAI's error shape; nothing a client sends makes a 500.

Runs against the shared fake-executor app (max_model_len 128, max_n 16,
max_logprobs 20, 64 KiB body limit, API key required).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.conftest import AUTH, MODEL, assert_engines_sound, wait_idle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def http(api_url):
    with httpx.Client(base_url=api_url, headers=AUTH, timeout=60) as client:
        yield client


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code", "request_id"}
    assert error["request_id"] == r.headers["x-request-id"]
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


# (path, body without model, words the message must hold)
BAD_PARAMS = [
    (COMPLETIONS, {"prompt": "x", "temperature": 5}, ["temperature", "[0.0, 2.0]", "5"]),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, ["temperature"]),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, ["top_p", "(0.0, 1.0]"]),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, ["max_tokens", "0 only with echo"]),
    (COMPLETIONS, {"prompt": "x", "max_tokens": True}, ["max_tokens"]),
    (COMPLETIONS, {"prompt": "x", "n": 100}, ["n", "[1, 16]"]),
    (COMPLETIONS, {"prompt": "x", "n": 10**9}, ["n", "[1, 16]"]),
    (COMPLETIONS, {"prompt": "x", "n": 0}, ["n"]),
    (COMPLETIONS, {"prompt": "x", "logprobs": 50}, ["logprobs", "[0, 20]"]),
    (COMPLETIONS, {"prompt": "x", "seed": -1}, ["seed"]),
    (COMPLETIONS, {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, ["min_tokens"]),
    (COMPLETIONS, {"prompt": "x", "priority": "high"}, ["priority"]),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [99999]}, ["stop_token_ids"]),
    (COMPLETIONS, {"prompt": 5}, ["prompt", "list of token ids"]),
    (COMPLETIONS, {"prompt": []}, ["prompt", "empty"]),
    (COMPLETIONS, {"prompt": [[1, 99999]]}, ["prompt", "token ids must be in"]),
    (COMPLETIONS, {"prompt": "\ud800"}, ["prompt", "surrogate"]),
    (COMPLETIONS, {"prompt": "x", "stop": ["a"] * 17}, ["stop", "16"]),
    (COMPLETIONS, {"prompt": "x", "stop": ""}, ["stop"]),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, ["logit_bias", "[-100.0, 100.0]"]),
    (COMPLETIONS, {"prompt": "x", "echo": "yes"}, ["echo"]),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "a(", "n": 2}, ["guided_regex", "compile"]),
    (COMPLETIONS, {"prompt": "x", "best_of": 3}, ["best_of"]),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, ["stream_options"]),
    (CHAT, {"messages": []}, ["messages", "empty"]),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, ["messages", "unknown role robot"]),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, ["messages.0"]),
    (CHAT, {"messages": [{"role": "user"}]}, ["messages.0.content"]),
    (CHAT, {"messages": MESSAGES, "chat_template": "{{ 7 * 7 }}"}, ["chat_template"]),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, ["top_logprobs", "logprobs"]),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 5000}, ["top_logprobs", "20"]),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": 0}, ["max_completion_tokens"]),
    (CHAT, {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, ["response_format"]),
    (CHAT, {"messages": MESSAGES, "echo": True}, ["echo", "not supported"]),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function"}]}, ["tools.0.function"]),
    (CHAT, {"messages": MESSAGES, "tool_choice": "required"}, ["tool_choice", "needs tools"]),
    (COMPLETIONS, {"prompt": "x", "top_k": -2}, ["top_k", "-1"]),
    (COMPLETIONS, {"prompt": "x", "max_completion_tokens": 0}, ["max_completion_tokens"]),
    (COMPLETIONS, {"prompt": "x", "include_stop_str_in_output": "no"}, ["include_stop_str"]),
]


@pytest.mark.parametrize("path, body, words", BAD_PARAMS, ids=[str(b) for _, b, _ in BAD_PARAMS])
def test_bad_parameters_are_400_naming_the_field(http, path, body, words):
    content = json.dumps({"model": MODEL, **body})  # ASCII-escaped: lone surrogates survive
    r = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert_error(r, 400, *words)


@pytest.mark.parametrize(
    "content",
    [b"{", b"[1, 2]", b'"x"', b"\xff\xfe", b"[" * 60000, b'{"max_tokens": ' + b"9" * 5000 + b"}"],
    ids=["truncated", "array", "string", "bad-utf8", "deep", "huge-int"],
)
def test_bodies_that_are_not_a_json_object_are_400(http, content):
    r = http.post(COMPLETIONS, content=content, headers={"Content-Type": "application/json"})
    assert_error(r, 400)


def test_missing_model_is_400_and_unknown_model_is_404(http):
    assert_error(http.post(COMPLETIONS, json={"prompt": "x"}), 400, "model")
    for path, body in ((COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": MESSAGES})):
        error = assert_error(http.post(path, json={"model": "gpt-4", **body}), 404, "gpt-4")
        assert error["code"] == "model_not_found" and error["param"] == "model"
    assert_error(http.get("/v1/models/gpt-4"), 404)


def test_context_overflow_states_the_limit_and_both_sizes(http):
    body = {"model": MODEL, "prompt": list(range(3, 103)), "max_tokens": 100}
    error = assert_error(http.post(COMPLETIONS, json=body), 400, "128", "200", "100 in the prompt")
    assert error["code"] == "context_length_exceeded"
    body = {"model": MODEL, "prompt": list(range(3, 131))}  # no room left at all
    assert_error(http.post(COMPLETIONS, json=body), 400, "128 tokens", "128 in the prompt")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 60}]}
    assert_error(http.post(CHAT, json={**chat, "max_tokens": 100}), 400, "in the messages")


def test_api_key_is_required_except_for_health(api_url):
    body = {"model": MODEL, "prompt": "x"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        r = httpx.post(f"{api_url}{COMPLETIONS}", json=body, headers=headers)
        assert_error(r, 401, "API key")
    assert_error(httpx.get(f"{api_url}/v1/models"), 401)
    assert_error(httpx.get(f"{api_url}/metrics"), 401)
    assert httpx.get(f"{api_url}/health").status_code == 200


def test_unknown_routes_are_404_and_wrong_methods_405(http):
    assert_error(http.get("/v1/nope"), 404, "/v1/nope")
    assert_error(http.post("/v2/completions", json={}), 404)
    assert_error(http.get(COMPLETIONS), 405, "GET")
    assert_error(http.delete("/v1/models"), 405)


def test_bodies_over_the_limit_are_413_by_header_or_by_size(http):
    big = {"model": MODEL, "prompt": "x" * 70000}
    assert_error(http.post(COMPLETIONS, json=big), 413, "65536")

    def chunks():  # no Content-Length: the limit must hold while reading
        yield b'{"model": "tiny-chat", "prompt": "'
        for _ in range(20):
            yield b"y" * 4096
        yield b'"}'

    assert_error(http.post(COMPLETIONS, content=chunks()), 413, "max_body_bytes")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = [
    "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed",
    "stop", "stop_token_ids", "logprobs", "top_logprobs", "min_tokens", "priority", "stream",
    "ignore_eos", "presence_penalty", "repetition_penalty", "stream_options", "logit_bias", "user",
    "tools", "tool_choice", "skip_special_tokens", "include_stop_str_in_output", "response_format",
    "continue_final_message", "add_generation_prompt", "chat_template_kwargs", "unknown_field",
]  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from([COMPLETIONS, CHAT]),
    fields=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=4),
)
def test_random_bodies_never_cause_a_500(api_url, path, fields):
    base = {"model": MODEL, "max_tokens": 4}
    base.update({"prompt": "hi"} if path == COMPLETIONS else {"messages": MESSAGES})
    body = json.dumps({**base, **fields}, allow_nan=True)
    r = httpx.post(f"{api_url}{path}", content=body, headers=AUTH, timeout=60)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["type"] == "invalid_request_error"


async def test_no_request_left_anything_behind(api_url):
    async with httpx.AsyncClient(base_url=api_url, headers=AUTH) as client:
        stats = await wait_idle(client)
    assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    await assert_engines_sound("api")
