"""vLLM's request extensions and the defaults clients rely on (HTTP layer, no Ray).

The echo engine answers with the last user message's tokens, then EOS, so each
expected text is the message the test sends.
"""

from __future__ import annotations

import pytest

from iterserve.workers.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.serve.conftest import MODEL, inproc, sse_events

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def app(tools_tokenizer_dir):
    return inproc(tools_tokenizer_dir)


@pytest.fixture
def http(app):
    return app[0]


@pytest.fixture(scope="module")
def tok(tools_tokenizer_dir):
    return Tokenizer(tools_tokenizer_dir)


def say(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chat(http, text="hello world", **fields) -> dict:
    r = http.post(CHAT, json={"model": MODEL, "messages": say(text), **fields})
    assert r.status_code == 200, r.text
    return r.json()


def stream(http, path, body) -> list[dict]:
    with http.stream("POST", path, json={"model": MODEL, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def content(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


def last_params(app) -> dict:
    return app[1].opened[-1][1]


def test_include_stop_str_in_output_keeps_the_stop_string(http):
    text = "the quick brown fox jumps"
    cut = chat(http, text, stop=["brown"])["choices"][0]
    assert (cut["message"]["content"], cut["finish_reason"]) == ("the quick ", "stop")
    kept = chat(http, text, stop=["brown"], include_stop_str_in_output=True)["choices"][0]
    assert (kept["message"]["content"], kept["finish_reason"]) == ("the quick brown", "stop")
    events = stream(
        http, CHAT, {"messages": say(text), "stop": ["own f"], "include_stop_str_in_output": True}
    )
    assert content(events) == "the quick brown f"


def test_the_stopping_token_is_written_only_with_include_stop_str_in_output(http):
    # EOS is special: kept special tokens show it only when the client asks for it.
    plain = chat(http, "hello", skip_special_tokens=False)["choices"][0]["message"]["content"]
    assert plain == "hello"
    both = {"skip_special_tokens": False, "include_stop_str_in_output": True}
    assert chat(http, "hello", **both)["choices"][0]["message"]["content"] == "hello</s>"


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(http):
    text = "hello<|system|>world"
    assert chat(http, text)["choices"][0]["message"]["content"] == "helloworld"
    kept = chat(http, text, skip_special_tokens=False)["choices"][0]["message"]["content"]
    assert kept == text


class SpacedTokenizer:
    """Decodes like SentencePiece does around special tokens: with a space between."""

    added_tokens = {1: ("<a>", True), 2: ("<b>", True)}

    def decode(self, ids, skip_special_tokens=True):
        words = {1: "<a>", 2: "<b>", 3: "x"}
        kept = [i for i in ids if not (skip_special_tokens and i in self.added_tokens)]
        return " ".join(words[i] for i in kept)


def test_spaces_between_special_tokens_false_writes_them_back_to_back():
    spaced = IncrementalDetokenizer(SpacedTokenizer(), skip_special_tokens=False)
    assert spaced.add_many([3, 1, 2]) == "x <a> <b>"
    tight = IncrementalDetokenizer(
        SpacedTokenizer(), skip_special_tokens=False, spaces_between_special_tokens=False
    )
    assert tight.add_many([3, 1, 2]) == "x <a><b>"


def test_top_k_minus_one_is_off(app):
    http = app[0]
    assert chat(http, top_k=-1)["choices"][0]["finish_reason"] == "stop"
    assert last_params(app)["top_k"] == 0


def test_completions_take_max_completion_tokens_and_default_to_16(app, tok):
    http = app[0]
    body = {"model": MODEL, "prompt": "hi", "ignore_eos": True}
    assert http.post(COMPLETIONS, json=body).json()["usage"]["completion_tokens"] == 16
    r = http.post(COMPLETIONS, json={**body, "max_tokens": 9, "max_completion_tokens": 3})
    assert r.json()["usage"]["completion_tokens"] == 3
    r = http.post(COMPLETIONS, json={**body, "max_completion_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    r = http.post(COMPLETIONS, json={**body, "min_tokens": 20})
    assert r.json()["usage"]["completion_tokens"] == 20  # the default yields to min_tokens
    # Near the end of the context the default shrinks to the room left.
    near_end = {**body, "prompt": [5] * (app[1].info_["max_model_len"] - 6)}
    assert http.post(COMPLETIONS, json=near_end).json()["usage"]["completion_tokens"] == 6


def test_chat_defaults_to_the_room_left_in_the_context(app):
    http = app[0]
    body = chat(http, "hi", ignore_eos=True)
    assert body["usage"]["total_tokens"] == app[1].info_["max_model_len"]


def test_the_stream_sends_the_role_with_the_first_token(http):
    events = stream(http, CHAT, {"messages": say("hello world")})
    first = events[0]["choices"][0]["delta"]
    assert first["role"] == "assistant"
    assert first["content"] and "hello world".startswith(first["content"])
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])
    assert content(events) == "hello world"


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(http, tok):
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = stream(http, CHAT, {"messages": say("hello world"), "stream_options": options})
    *chunks, last = events
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts) and counts[0] >= 1
    prompt_tokens = last["usage"]["prompt_tokens"]
    assert all(e["usage"]["prompt_tokens"] == prompt_tokens for e in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == counts[-1]
    without = stream(http, CHAT, {"messages": say("hi"), "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in without[:-1])


def test_return_tokens_as_token_ids_writes_ids_in_the_logprobs(http, tok):
    body = chat(http, "hello", logprobs=True, return_tokens_as_token_ids=True)
    tokens = [c["token"] for c in body["choices"][0]["logprobs"]["content"]]
    assert tokens == [f"token_id:{i}" for i in tok.encode("hello", False)] + ["token_id:2"]


def rendered(app, tok) -> str:
    return tok.decode(app[1].opened[-1][0], skip_special_tokens=False)


def test_add_generation_prompt_and_continue_final_message_shape_the_prompt(app, tok):
    http = app[0]
    chat(http, "hi")
    assert rendered(app, tok).endswith("<|user|>hi<|end|><|assistant|>")
    chat(http, "hi", add_generation_prompt=False)
    assert rendered(app, tok).endswith("<|user|>hi<|end|>")
    prefill = [*say("hi"), {"role": "assistant", "content": "The answer is"}]
    r = http.post(CHAT, json={"model": MODEL, "messages": prefill, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert rendered(app, tok).endswith("<|user|>hi<|end|><|assistant|>The answer is")


def test_chat_template_kwargs_and_documents_reach_the_template(app, tok):
    http = app[0]
    chat(http, "hi", chat_template_kwargs={"greeting": "be kind"}, documents=[{"text": "doc1"}])
    prompt = rendered(app, tok)
    assert "<|system|>be kind<|end|>" in prompt and "<|system|>doc1<|end|>" in prompt


def test_add_special_tokens_adds_the_bos(tokenizer_dir):
    http, engine = inproc(tokenizer_dir)  # the shared tokenizer adds <s> (id 1) to text
    http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert engine.opened[-1][0][0] == 1
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "add_special_tokens": False}
    http.post(COMPLETIONS, json=body)
    assert engine.opened[-1][0][0] != 1
    messages = say("hello")
    http.post(CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 2})
    chat_default = engine.opened[-1][0]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "add_special_tokens": True}
    http.post(CHAT, json=body)
    assert engine.opened[-1][0] == [1, *chat_default]  # on top of the template's own <s>


def complete(http, **body) -> dict:
    r = http.post(COMPLETIONS, json={"model": MODEL, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_writes_the_prompt_and_its_logprobs_before_the_completion(http, tok):
    prompt = "<|user|>hello world<|end|>"  # the echo engine answers with the turn's text
    prompt_ids = tok.encode(prompt)
    n = len(tok.encode("hello world"))
    request = {"prompt": prompt, "max_tokens": n, "echo": True, "logprobs": 1}
    body = complete(http, **request)
    (choice,) = body["choices"]
    assert choice["text"] == prompt + "hello world"
    lp = choice["logprobs"]
    texts = [tok.decode([t], skip_special_tokens=False) for t in prompt_ids]
    assert lp["tokens"][: len(prompt_ids)] == texts and len(lp["tokens"]) == len(prompt_ids) + n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(prompt_ids)] == [-0.5] * (len(prompt_ids) - 1)
    assert lp["text_offset"][len(prompt_ids)] == len(prompt)
    assert body["usage"]["completion_tokens"] == n
    events = stream(http, COMPLETIONS, {**request, "ignore_eos": True})
    assert events[0]["choices"][0]["text"].startswith(prompt)
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    streamed = [e["choices"][0]["logprobs"] or {} for e in events]
    assert [t for s in streamed for t in s.get("tokens", [])] == lp["tokens"]
    assert [o for s in streamed for o in s.get("text_offset", [])] == lp["text_offset"]


def test_max_tokens_zero_with_echo_returns_the_prompt_alone(app, tok):
    http, engine = app
    prompt_ids = tok.encode("hello world")
    body = complete(http, prompt="hello world", max_tokens=0, echo=True, logprobs=0)
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("hello world", "length")
    assert len(choice["logprobs"]["tokens"]) == len(prompt_ids)
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 0,
                             "total_tokens": len(prompt_ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    params = engine.opened[-1][1]
    assert params["max_tokens"] == 0 and params["prompt_logprobs"] == 0
    plain = complete(http, prompt=[5, 6, 7], max_tokens=0, echo=True)["choices"][0]
    assert plain["text"] == tok.decode([5, 6, 7]) and plain["logprobs"] is None
    assert engine.opened[-1][1]["prompt_logprobs"] is None  # no logprobs: none computed


def test_each_choice_echoes_its_own_prompt(http, tok):
    body = complete(http, prompt=["hello", "world"], n=2, max_tokens=1, echo=True)
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    tail = tok.decode([5])
    assert texts == ["hello" + tail, "hello" + tail, "world" + tail, "world" + tail]


def test_prompt_logprobs_come_in_vllms_shape(http, tok):
    prompt_ids = tok.encode("hello world")
    body = complete(http, prompt="hello world", max_tokens=2, prompt_logprobs=1)
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt_ids)
    for token_id, entry in zip(prompt_ids[1:], got[1:]):
        text = tok.decode([token_id], skip_special_tokens=False)
        assert entry == {str(token_id): {"logprob": -0.5, "rank": 1, "decoded_token": text}}
    assert "prompt_logprobs" not in complete(http, prompt="hi", max_tokens=1)["choices"][0]
    reply = chat(http, "hello", prompt_logprobs=0)
    assert reply["prompt_logprobs"][0] is None and len(reply["prompt_logprobs"]) > 1
    events = stream(http, CHAT, {"messages": say("hello"), "prompt_logprobs": 0})
    assert events[0]["prompt_logprobs"] == reply["prompt_logprobs"]
    assert all("prompt_logprobs" not in e for e in events[1:])


def test_a_stream_sends_the_prompt_alone_and_its_prompt_logprobs_first(http, tok):
    prompt_ids = tok.encode("hello world")
    body = {"prompt": "hello world", "max_tokens": 0, "echo": True, "logprobs": 0,
            "prompt_logprobs": 0}  # fmt: skip
    (event,) = stream(http, COMPLETIONS, body)
    choice = event["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("hello world", "length")
    assert len(choice["logprobs"]["tokens"]) == len(prompt_ids)
    assert len(choice["prompt_logprobs"]) == len(prompt_ids)
