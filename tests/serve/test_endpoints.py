"""The endpoints clients probe besides generation (HTTP layer, no Ray): /tokenize,
/detokenize, /version, CORS, /metrics' key, and unsupported OpenAI endpoints."""

from __future__ import annotations

import pytest

from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import API_KEY, AUTH, MODEL, inproc

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def app(tools_tokenizer_dir):
    return inproc(tools_tokenizer_dir, settings={"api_key": API_KEY})


@pytest.fixture
def http(app):
    return app[0]


@pytest.fixture(scope="module")
def tok(tools_tokenizer_dir):
    return Tokenizer(tools_tokenizer_dir)


def test_tokenize_a_prompt(http, tok):
    r = http.post(
        "/tokenize", json={"prompt": "hello world", "return_token_strs": True}, headers=AUTH
    )
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok.encode("hello world")
    assert body == {
        "count": len(ids),
        "max_model_len": 1024,
        "tokens": ids,
        "token_strs": [tok.id_to_token(i) for i in ids],
    }
    plain = http.post("/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=AUTH).json()
    assert plain["token_strs"] is None


def test_tokenize_messages_counts_the_prompt_chat_would_send(app, tok):
    http, engine = app
    messages = [{"role": "user", "content": "hello"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    counted = http.post("/tokenize", json={"messages": messages, "tools": tools}, headers=AUTH)
    assert counted.status_code == 200, counted.text
    body = {"model": MODEL, "messages": messages, "tools": tools, "tool_choice": "none"}
    reply = http.post("/v1/chat/completions", json=body, headers=AUTH).json()
    assert counted.json()["tokens"] == engine.opened[-1][0]
    assert counted.json()["count"] == reply["usage"]["prompt_tokens"]
    prefill = {"messages": [*messages, {"role": "assistant", "content": "Sure"}]}
    prefill["continue_final_message"] = True
    ids = http.post("/tokenize", json=prefill, headers=AUTH).json()["tokens"]
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|assistant|>Sure")


def test_detokenize_turns_ids_back_into_text(http, tok):
    ids = tok.encode("hello world")
    r = http.post("/detokenize", json={"tokens": ids}, headers=AUTH)
    assert r.json() == {"prompt": "hello world"}
    r = http.post("/detokenize", json={"tokens": [5, 99999]}, headers=AUTH)
    assert r.status_code == 400 and "tokens: token ids must be in" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "gpt-4"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages: must not be empty"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "x"},
            400,
            "chat_template",
        ),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_tokenize_requests_are_refused(http, path, body, status, words):
    r = http.post(path, json=body, headers=AUTH)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text


def test_version_answers_the_servers_version(http):
    version = http.get("/version", headers=AUTH).json()["version"]
    assert version and version[0].isdigit()


def test_no_cors_headers_unless_origins_are_configured(http):
    r = http.get("/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers


def test_cors_preflight_is_answered_before_the_key_is_checked(tools_tokenizer_dir):
    settings = {"api_key": API_KEY, "cors_allowed_origins": (ORIGIN,)}
    http, _ = inproc(tools_tokenizer_dir, settings=settings)
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = http.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    # A simple request gets the headers too, errors included, so the page can read them.
    ok = http.get("/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in ok.headers["access-control-expose-headers"]
    denied = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    # Another origin's preflight is refused, and gets no allow header.
    other = http.options("/v1/models", headers={**preflight, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_metrics_need_the_key_unless_configured_otherwise(http, tools_tokenizer_dir):
    assert http.get("/metrics").status_code == 401
    assert http.get("/metrics", headers=AUTH).status_code == 200
    settings = {"api_key": API_KEY, "metrics_require_api_key": False}
    open_http, _ = inproc(tools_tokenizer_dir, settings=settings)
    assert open_http.get("/metrics").status_code == 200
    assert open_http.get("/v1/models").status_code == 401  # only /metrics opens


@pytest.mark.parametrize(
    "method, path, words",
    [
        ("POST", "/v1/moderations", "moderations (POST /v1/moderations) is not supported"),
        ("GET", "/v1/files/file_1", "files"),
        ("POST", "/v1/embeddings", "embeddings"),
    ],
)
def test_unsupported_openai_endpoints_say_so(http, method, path, words):
    r = http.request(method, path, json={"model": MODEL}, headers=AUTH)
    assert r.status_code == 404
    error = r.json()["error"]
    assert words in error["message"] and error["code"] == "unsupported_endpoint"
