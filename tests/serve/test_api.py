"""The API over HTTP with the fake executor: shapes, streaming, n, stop, logprobs.

The fake's tokens depend only on the engine request id, which is
``<X-Request-Id>-<choice index>``, so every text below is predicted exactly.
"""

from __future__ import annotations

import time

import httpx
import pytest

from iterserve.scheduler import FakeExecutor, SamplingParams
from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import API_KEY, AUTH, MODEL, sse_events


@pytest.fixture
def api(api_url):
    return api_url


@pytest.fixture
def http(api):
    with httpx.Client(base_url=api, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return Tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def predict(vocab_size, tok):
    fake = FakeExecutor(vocab_size=vocab_size, output_len=12)

    def predict(engine_request_id: str, **params) -> tuple[str, list[int], str]:
        tokens, reason = fake.expected_output(engine_request_id, SamplingParams(**params))
        return tok.decode(tokens), tokens, reason

    return predict


def post(http, path, body, request_id=None, **kw):
    headers = {"X-Request-Id": request_id} if request_id else {}
    return http.post(path, json={"model": MODEL, **body}, headers=headers, **kw)


def stream(http, path, body, request_id) -> tuple[httpx.Response, list[dict]]:
    """The response (headers) and the SSE payloads of a streamed request."""
    body = {"model": MODEL, **body, "stream": True}
    with http.stream("POST", path, json=body, headers={"X-Request-Id": request_id}) as r:
        assert r.status_code == 200, r.read()
        return r, sse_events(r.iter_lines())


def test_completion_is_the_engines_tokens_as_text(http, tok, predict):
    r = post(http, "/v1/completions", {"prompt": "hello world", "max_tokens": 5}, "c1")
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "c1"
    body = r.json()
    text, _, _ = predict("c1-0", max_tokens=5)
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].endswith("c1")
    (choice,) = body["choices"]
    assert (choice["index"], choice["text"], choice["finish_reason"]) == (0, text, "length")
    prompt_tokens = len(tok.encode("hello world"))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_eos_finishes_with_stop_and_the_default_max_tokens(http, tok, predict):
    body = post(http, "/v1/completions", {"prompt": "hello"}, "c2").json()
    text, tokens, reason = predict("c2-0", max_tokens=100)
    assert reason == "eos" and len(tokens) == 12
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == text  # EOS itself writes nothing
    # Completions default to OpenAI's 16 tokens; chat fills the context, as vLLM does.
    body = post(http, "/v1/completions", {"prompt": [7, 8, 9], "ignore_eos": True}, "c3").json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 16
    messages = [{"role": "user", "content": "hi"}]
    body = post(http, "/v1/chat/completions", {"messages": messages, "ignore_eos": True}).json()
    assert body["usage"]["total_tokens"] == 128  # max_model_len


def test_streamed_completion_matches_the_prediction(http, predict):
    body = {"prompt": "hello", "max_tokens": 9, "stream_options": {"include_usage": True}}
    r, events = stream(http, "/v1/completions", body, "s1")
    assert r.headers["content-type"].startswith("text/event-stream")
    *chunks, last = events
    assert "".join(c["choices"][0]["text"] for c in chunks) == predict("s1-0", max_tokens=9)[0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 9


def test_chat_renders_the_template_and_answers(http, tok, predict):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 4}, "h1")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": predict("h1-0", max_tokens=4)[0]}
    prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(prompt)


def test_chat_stream_opens_with_the_role_and_the_first_token_and_ends_with_done(http, tok, predict):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    _, events = stream(http, "/v1/chat/completions", {**body, "max_tokens": 6}, "h2")
    text, tokens, _ = predict("h2-0", max_tokens=6)
    first = events[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and text.startswith(first["content"])
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == text
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_unknown_fields_pass_the_proxy_and_come_back_named(http):
    body = {"prompt": "hi", "max_tokens": 2, "min_tokens_per_second": 5}
    r = post(http, "/v1/completions", {**body, "stream_options": None})
    assert r.status_code == 200, r.text
    assert r.headers["x-iterserve-ignored-fields"] == "min_tokens_per_second"


def test_n_choices_and_batched_prompts_are_separate_engine_requests(http, predict):
    body = post(http, "/v1/completions", {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 3}, "n1")
    choices = body.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        assert c["text"] == predict(f"n1-{c['index']}", max_tokens=3)[0]
    assert len({c["text"] for c in choices}) == 4
    assert body.json()["usage"]["completion_tokens"] == 12


def test_logprobs_come_per_token(http):
    body = post(http, "/v1/completions", {"prompt": "x", "max_tokens": 4, "logprobs": 1}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 4
    assert all(len(top) == 1 for top in logprobs["top_logprobs"])
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    chat.update(logprobs=True, top_logprobs=1)
    content = post(http, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 1 for c in content)


def test_stop_token_ids_end_with_stop(http, predict):
    _, tokens, _ = predict("t1-0", max_tokens=11)
    k = next(i for i in range(2, 11) if tokens.index(tokens[i]) == i)
    body = {"prompt": "hi", "max_tokens": 11, "stop_token_ids": [tokens[k]]}
    choice = post(http, "/v1/completions", body, "t1").json()
    assert choice["choices"][0]["finish_reason"] == "stop"
    assert choice["usage"]["completion_tokens"] == k + 1


def _cross_boundary_stop(tok, tokens) -> tuple[str, str] | None:
    """A 4-character stop string around a token boundary, and the text before it."""
    full = tok.decode(tokens)
    for k in range(1, len(tokens) - 1):
        head = tok.decode(tokens[: k + 1])
        b = len(head)
        if not full.startswith(head) or not 2 <= b <= len(full) - 2:
            continue
        stop = full[b - 2 : b + 2]
        if "\ufffd" not in stop and full.find(stop) == b - 2:
            return stop, full[: b - 2]
    return None


def test_stop_string_across_a_token_boundary_cuts_the_text(http, tok, predict):
    for attempt in range(50):
        rid = f"stop{attempt}"
        found = _cross_boundary_stop(tok, predict(f"{rid}-0", max_tokens=11)[1])
        if found:
            break
    stop, before = found
    body = {"prompt": "hi", "max_tokens": 11, "stop": ["never-there", stop]}
    r = post(http, "/v1/completions", body, rid).json()
    assert r["choices"][0]["text"] == before
    assert r["choices"][0]["finish_reason"] == "stop"
    _, events = stream(http, "/v1/completions", body, rid)
    assert "".join(e["choices"][0]["text"] for e in events) == before
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_models_health_stats_and_metrics(http, api):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] > 0  # asked of the engines, not left out
    assert http.get(f"/v1/models/{MODEL}").status_code == 200
    assert httpx.get(f"{api}/health").json()["status"] == "ok"  # no key needed
    stats = http.get("/v1/stats").json()
    assert stats["policy"] == "chunked" and stats["num_engine_replicas"] == 1
    for key in ("num_running", "num_waiting", "slot_utilization", "kv_usage", "slots_total"):
        assert key in stats
    from prometheus_client.parser import text_string_to_metric_families

    # Engines push their metrics to the hub every second: wait for a push that has
    # seen this module's traffic.
    for _ in range(100):
        r = http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(r.text)}
        generated = families.get("iterserve_generation_tokens")
        if generated and generated.samples[0].value > 0:
            break
        time.sleep(0.1)
    assert families["iterserve_slots_capacity"].samples[0].value == 16
    assert families["iterserve_generation_tokens"].samples[0].value > 0
    sample = families["iterserve_slots_capacity"].samples[0]
    assert sample.labels == {"model_name": MODEL, "engine": "0"}


def test_the_official_openai_client_works(api):
    import openai

    client = openai.OpenAI(base_url=f"{api}/v1", api_key=API_KEY, max_retries=0)
    completion = client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 3
    parts = [
        chunk.choices[0].text
        for chunk in client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True)
    ]
    assert parts
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, n=2, seed=1)
    assert [c.index for c in chat.choices] == [0, 1]
    options = {"include_usage": True}
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, stream=True, stream_options=options
        )
    )
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", temperature=3.0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=messages)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{api}/v1", api_key="wrong", max_retries=0).models.list()
