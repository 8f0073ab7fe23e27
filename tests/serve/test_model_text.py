"""Text-level behaviour on a tiny real Llama with a real byte-level BPE tokenizer:
stop strings across token boundaries, the chat template, seeded sampling."""

from __future__ import annotations

import httpx
import pytest

from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import deploy, sse_events, tiny_model_engine, undeploy

APP = "text"
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def text_url(serve_url, tiny_model_dir):
    yield deploy(serve_url, APP, model=str(tiny_model_dir), config=tiny_model_engine())
    undeploy(APP)


@pytest.fixture
def http(text_url):
    with httpx.Client(base_url=text_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True, "max_tokens": 32}


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={**GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream_text(http, path: str, body: dict) -> tuple[str, str]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    choices = [e["choices"][0] for e in events if e["choices"]]
    if path.endswith("/chat/completions"):
        text = "".join(c["delta"].get("content", "") for c in choices)
    else:
        text = "".join(c["text"] for c in choices)
    return text, choices[-1]["finish_reason"]


def test_stop_strings_that_span_tokens_cut_the_text_before_them(http, tok):
    # A repetition penalty keeps the random model from looping on one token.
    prompt = {"prompt": "the quick brown fox", "repetition_penalty": 1.8}
    full = complete(http, **prompt)["choices"][0]["text"]
    # Longer than any single token's text: the stop string must span two tokens or more.
    longest = max(len(tok.decode([i])) for i in range(tok.vocab_size))
    length = longest + 1
    starts = [i for i in range(1, len(full) - length) if full.find(full[i : i + length]) == i]
    assert starts, f"no usable stop string in {full!r}"
    for start in (starts[0], starts[len(starts) // 2]):
        stop = full[start : start + length]
        body = {**prompt, "stop": [stop, "\x00never"]}
        choice = complete(http, **body)["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (full[:start], "stop")
        # Streaming holds back what could start the stop string, and never sends it.
        assert stream_text(http, "/v1/completions", {**GREEDY, **body}) == (full[:start], "stop")
    # A stop string that never matches changes nothing.
    assert complete(http, **prompt, stop="\x00")["choices"][0]["text"] == full


def test_chat_uses_the_models_template(http, tok):
    messages = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello"}]
    r = http.post("/v1/chat/completions", json={**GREEDY, "messages": messages})
    assert r.status_code == 200, r.text
    chat = r.json()
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert chat["usage"]["prompt_tokens"] == len(ids)
    # The same token ids through /v1/completions give the same greedy answer.
    same = complete(http, prompt=ids)["choices"][0]["text"]
    assert chat["choices"][0]["message"]["content"] == same
    text, reason = stream_text(http, "/v1/chat/completions", {**GREEDY, "messages": messages})
    assert (text, reason) == (same, "length")


def test_a_seed_makes_sampling_reproducible_and_n_derives_seeds(http):
    body = {"prompt": "hello", "temperature": 1.0, "max_tokens": 16, "ignore_eos": True}
    first = complete(http, **body, seed=1234)["choices"][0]["text"]
    assert complete(http, **body, seed=1234)["choices"][0]["text"] == first
    others = {complete(http, **body, seed=s)["choices"][0]["text"] for s in (1, 2, 3)}
    assert others - {first}, "different seeds should not all give the same text"
    both = complete(http, **body, seed=1234, n=2)["choices"]
    assert both[0]["text"] == first
    assert both[1]["text"] == complete(http, **body, seed=1235)["choices"][0]["text"]


def test_the_openai_client_streams_chat_from_the_model(text_url):
    import openai

    client = openai.OpenAI(base_url=f"{text_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content == text
