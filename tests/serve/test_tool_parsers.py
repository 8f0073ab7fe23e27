"""Tool-call parsers on their own: what counts as a call, and that a text split
anywhere streams to the same calls and content as the whole text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iterserve.cluster.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
    NamedParser,
    Parsed,
    parse_whole,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def calls(parsed: Parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def streamed(parser, pieces: list[str]) -> Parsed:
    out = Parsed()
    for piece in pieces:
        out += parser.feed(piece)
    return out + parser.finish()


def test_hermes_reads_calls_and_keeps_the_text_before_them():
    text = f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>"
    parsed = parse_whole(HermesParser(), text)
    assert parsed.content == "Let me look.\n"
    assert calls(parsed) == [("get_weather", {"city": "Paris"})]
    assert parsed.calls[0].id.startswith("call_")


def test_hermes_reads_several_calls_and_drops_the_whitespace_between_them():
    second = '{"name": "get_time", "arguments": {}}'
    text = f"<tool_call>{WEATHER}</tool_call>\n\n<tool_call>{second}</tool_call>\n"
    parsed = parse_whole(HermesParser(), text)
    assert parsed.content == ""
    assert [name for name, _ in calls(parsed)] == ["get_weather", "get_time"]
    assert len({c.id for c in parsed.calls}) == 2


def test_hermes_takes_an_unclosed_last_call_and_parameters_as_arguments():
    parsed = parse_whole(HermesParser(), '<tool_call>{"name": "f", "parameters": {"x": 1}}')
    assert calls(parsed) == [("f", {"x": 1})]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {"x": 1',  # cut off
        "plain text with a < sign and <tool_ca",
    ],
)
def test_hermes_leaves_what_is_not_a_valid_call_as_content(text):
    parsed = parse_whole(HermesParser(), text)
    assert parsed.calls == [] and parsed.content == text


def test_hermes_keeps_text_after_a_call_when_it_is_more_than_whitespace():
    parsed = parse_whole(HermesParser(), f"<tool_call>{WEATHER}</tool_call>\nDone.")
    assert parsed.content == "\nDone." and len(parsed.calls) == 1


def test_llama3_json_reads_one_or_more_calls_with_or_without_the_python_tag():
    one = parse_whole(Llama3JsonParser(), '{"name": "f", "parameters": {"x": 1}}')
    assert calls(one) == [("f", {"x": 1})] and one.content == ""
    two = '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"y": "z"}}'
    assert calls(parse_whole(Llama3JsonParser(), two)) == [("f", {}), ("g", {"y": "z"})]


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 4.",
        'Here: {"name": "f", "parameters": {}}',  # text first: not a call
        '{"name": "f", "parameters": {}} and more words',
        '{"name": "f", "parameters": {"x": ',  # cut off
        '{"a": 1}',
        "   ",
    ],
)
def test_llama3_json_output_that_is_not_only_calls_is_content(text):
    parsed = parse_whole(Llama3JsonParser(), text)
    assert parsed.calls == [] and parsed.content == text


def test_llama3_json_streams_plain_text_as_it_comes():
    parser = Llama3JsonParser()
    assert parser.feed("  ") == Parsed()  # undecided
    assert parser.feed("Hi") == Parsed("  Hi")
    assert parser.feed(" there") == Parsed(" there")


def test_the_parsers_for_constrained_tool_choices():
    array = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'
    assert calls(parse_whole(JsonArrayParser(), array)) == [("f", {"x": 1}), ("g", {})]
    assert parse_whole(JsonArrayParser(), "[]").content == "[]"  # no call: content
    assert calls(parse_whole(NamedParser("f"), '{"x": 1}')) == [("f", {"x": 1})]


def test_the_server_option_names_each_parser():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json"}


HERMES_TEXTS = st.sampled_from(
    [
        f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call>",
        f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{WEATHER}</tool_call>",
        "no call <tool_c at all < > </tool_call>",
        "<tool_call>broken</tool_call> after",
        f"<tool_call>{WEATHER}",
    ]
)
LLAMA_TEXTS = st.sampled_from(
    [
        '{"name": "f", "parameters": {"x": 1}}',
        ' <|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}',
        "plain words { not json",
        '{"name": "f"',
    ]
)


def _cuts(text: str, draw) -> list[str]:
    points = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@given(st.data())
def test_any_split_of_the_text_streams_what_the_whole_text_parses_to(data):
    parser_cls, texts = data.draw(
        st.sampled_from([(HermesParser, HERMES_TEXTS), (Llama3JsonParser, LLAMA_TEXTS)])
    )
    text = data.draw(texts)
    whole = parse_whole(parser_cls(), text)
    pieces = streamed(parser_cls(), _cuts(text, data.draw))
    assert pieces.content == whole.content
    assert [(c.name, c.arguments) for c in pieces.calls] == [
        (c.name, c.arguments) for c in whole.calls
    ]


def test_a_required_list_cut_short_keeps_the_calls_it_completed():
    """``tool_choice: required`` output cut by max_tokens: the calls whose JSON was
    complete are calls; the cut one is dropped, and nothing is content."""
    cut = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "param'
    parsed = parse_whole(JsonArrayParser(), cut)
    assert calls(parsed) == [("f", {"x": 1})] and parsed.content == ""
    assert parse_whole(JsonArrayParser(), '[{"name": "f", "par') == Parsed()


def test_a_required_list_streams_each_call_once_its_json_is_complete():
    parser = JsonArrayParser()
    pieces = [
        '[{"name": "f", ',
        '"parameters": {"x": [1, "]"]}}',
        ', {"name"',
        ': "g", "parameters": {}}]',
    ]
    got = [calls(parser.feed(piece)) for piece in pieces]
    assert got == [[], [("f", {"x": [1, "]"]})], [], [("g", {})]]
    assert parser.finish() == Parsed()
