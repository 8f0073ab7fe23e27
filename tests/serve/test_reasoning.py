"""Reasoning output: the ``<think>`` block split off the answer, whole and streamed,
in chat messages and deltas; tool calls read from the answer only.

The echo engine's output is the last user message, so each test writes the
"model's" output, think tags included (special tokens of this tokenizer).
"""

from __future__ import annotations

import pytest

from iterserve.cluster.openai.reasoning import (
    ANSWER,
    REASONING,
    UNDECIDED,
    Split,
    reasoning_parser,
)
from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import MODEL, inproc, sse_events
from tests.serve.echo import build_tools_tokenizer

CHAT = "/v1/chat/completions"
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("reasoning") / "tiny-think"
    return build_tools_tokenizer(path, extra_special=("<think>", "</think>"))


@pytest.fixture(scope="module")
def tok(think_dir):
    return Tokenizer(think_dir)


def split(parser, prompt: str, output: str, pieces: int = 1) -> Split:
    """The output fed in ``pieces`` characters at a time, then finished."""
    text = parser.text(prompt)
    out = Split()
    for i in range(0, len(output), pieces):
        out += text.feed(output[i : i + pieces])
    return out + text.finish()


@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_qwen3_splits_a_block_the_output_opens(tok, pieces):
    qwen3 = reasoning_parser("qwen3", tok)
    got = split(qwen3, "<|assistant|>", "<think>\nwhy not</think>\n\nthe answer", pieces)
    assert got == Split("why not", "the answer")
    # An output that opens no block is all answer; a tag later on is text.
    assert split(qwen3, "", "plain <think>x</think>", pieces) == Split("", "plain <think>x</think>")


@pytest.mark.parametrize("pieces", [1, 2, 1000])
def test_the_prompt_decides_whether_the_output_starts_in_the_block(tok, pieces):
    qwen3 = reasoning_parser("qwen3", tok)
    r1 = reasoning_parser("deepseek_r1", tok)
    assert qwen3.initial_state("x<|assistant|>") == UNDECIDED
    assert qwen3.initial_state("x<|assistant|><think>\n") == REASONING
    assert r1.initial_state("x<|assistant|>") == REASONING
    # A prompt that closes an empty block (enable_thinking: false) leaves only the answer.
    for parser in (qwen3, r1):
        closed = "<|assistant|><think>\n\n</think>\n\n"
        assert parser.initial_state(closed) == ANSWER
        assert parser.grammar_start(closed) is None
        assert split(parser, closed, "a</think>b", pieces) == Split("", "a</think>b")
    assert split(qwen3, "<think>\n", "plan</think>answer", pieces) == Split("plan", "answer")
    # DeepSeek-R1 thinks first; a <think> it writes itself is dropped.
    assert split(r1, "", "plan</think>answer", pieces) == Split("plan", "answer")
    assert split(r1, "", " <think>\nplan</think>answer", pieces) == Split("plan", "answer")
    assert r1.grammar_start("") == tok.token_to_id("</think>")


@pytest.mark.parametrize("pieces", [1, 1000])
def test_an_output_cut_inside_the_block_is_all_reasoning(tok, pieces):
    qwen3 = reasoning_parser("qwen3", tok)
    assert split(qwen3, "", "<think>still going </thi", pieces) == Split("still going </thi")
    assert split(qwen3, "", "<thi", pieces) == Split("", "<thi")  # never became a tag


def test_a_partial_tag_is_held_back_until_it_is_known():
    text = reasoning_parser("deepseek_r1", _Vocab()).text("")
    assert text.feed("plan</thi") == Split("plan", "")
    assert text.feed("nk>\n") == Split("", "")
    assert text.feed("\nans") == Split("", "ans")
    assert text.finish() == Split()


def test_reasoning_tokens_are_counted_on_the_token_ids(tok):
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    text = reasoning_parser("qwen3", tok).text("")
    text.count([start, 10, 11])
    text.count([12, end, 13, 14])
    assert text.num_reasoning_tokens == 5  # the tags are the reasoning's tokens
    plain = reasoning_parser("qwen3", tok).text("")
    plain.count([10, start, end])
    assert plain.num_reasoning_tokens == 0


def test_a_tokenizer_without_the_tags_is_refused_by_name(tools_tokenizer_dir):
    with pytest.raises(ValueError, match="no <think> token"):
        reasoning_parser("qwen3", Tokenizer(tools_tokenizer_dir))
    with pytest.raises(ValueError, match="must be one of qwen3, deepseek_r1"):
        reasoning_parser("o1", Tokenizer(tools_tokenizer_dir))


class _Vocab:
    def token_to_id(self, token):
        return {"<think>": 1, "</think>": 2}[token]


# -- over HTTP ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(think_dir):
    return inproc(think_dir, tool_call_parser="hermes", reasoning_parser="qwen3")


def ask(http, reply: str, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": reply}], **fields}
    return http.post(CHAT, json=body)


def stream(http, reply: str, **fields) -> list[dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": reply}], "stream": True}
    with http.stream("POST", CHAT, json={**body, **fields}) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def test_chat_message_carries_reasoning_and_its_older_name(http):
    r = ask(http, "<think>the user wants words</think>\n\nhello world")
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "hello world"
    assert message["reasoning"] == message["reasoning_content"] == "the user wants words"
    plain = ask(http, "hello world").json()["choices"][0]["message"]
    assert plain["content"] == "hello world" and plain["reasoning"] is None


def test_chat_stream_deltas_carry_the_reasoning_then_the_answer(http):
    events = stream(http, "<think>the user wants words</think>\n\nhello world")
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    assert reasoning == "the user wants words"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "hello world"
    assert deltas[0]["role"] == "assistant"


def test_tool_calls_are_read_from_the_answer_only(http):
    inside = f"<think>maybe {CALL}</think>no call"
    message = ask(http, inside, tools=[WEATHER]).json()["choices"][0]["message"]
    assert message["reasoning"] == f"maybe {CALL}" and message.get("tool_calls") is None
    r = ask(http, f"<think>I should call it</think>{CALL}", tools=[WEATHER])
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"] == "I should call it"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    events = stream(http, f"<think>I should call it</think>{CALL}", tools=[WEATHER])
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_include_reasoning_false_leaves_it_out(http):
    r = ask(http, "<think>secret</think>hello world", include_reasoning=False)
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "hello world" and "reasoning" not in message
    events = stream(http, "<think>secret</think>hello world", include_reasoning=False)
    assert not any("reasoning" in e["choices"][0]["delta"] for e in events if e["choices"])


def test_structured_outputs_start_after_the_reasoning_block(app, tok):
    form = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    r = ask(app[0], "<think>hmm</think>{}", response_format=form)
    assert r.status_code == 200, r.text
    spec = app[1].opened[-1][1]["structured_output"]
    assert spec["start_after"] == tok.token_to_id("</think>")
    # A prompt that closed the block (as enable_thinking: false does) leaves the grammar
    # on from the first token.
    closed = [
        {"role": "user", "content": "{}"},
        {"role": "assistant", "content": "<think>\n\n</think>\n\n"},
    ]
    body = {"model": MODEL, "messages": closed, "response_format": form}
    r = app[0].post(CHAT, json={**body, "continue_final_message": True,
                                "add_generation_prompt": False})  # fmt: skip
    assert r.status_code == 200, r.text
    assert tok.decode(app[1].opened[-1][0], skip_special_tokens=False).endswith("</think>\n\n")
    assert app[1].opened[-1][1]["structured_output"]["start_after"] is None
