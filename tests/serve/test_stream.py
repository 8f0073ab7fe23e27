"""Stop strings over arbitrarily split text: the cut is exact and nothing past it leaks."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from iterserve.cluster.openai.stream import StopMatcher, sse

ALPHABET = "abcé✓"


def run(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    matcher = StopMatcher(stops)
    emitted = []
    for piece in pieces:
        text, matched = matcher.feed(piece)
        emitted.append(text)
        if matched:
            return emitted, True
    text, matched = matcher.flush()
    emitted.append(text)
    return emitted, matched


@given(
    pieces=st.lists(st.text(ALPHABET, max_size=4), max_size=12),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
)
def test_output_is_the_text_before_the_first_stop(pieces, stops):
    full = "".join(pieces)
    hits = [i for i in (full.find(s) for s in stops) if i >= 0]
    emitted, matched = run(pieces, stops)
    assert matched == bool(hits)
    assert "".join(emitted) == (full[: min(hits)] if hits else full)


@given(
    pieces=st.lists(st.text(ALPHABET, max_size=4), max_size=12),
    stop=st.text(ALPHABET, min_size=2, max_size=4),
)
def test_nothing_that_could_start_a_stop_is_emitted_early(pieces, stop):
    matcher = StopMatcher([stop])
    sent = ""
    for piece in pieces:
        text, matched = matcher.feed(piece)
        sent += text
        if matched:
            break
        # Any start of the stop string at the end of the text so far is still held
        # back: the unseen rest of the stream may complete it.
        so_far = sent + matcher.pending
        for k in range(1, len(stop)):
            if so_far.endswith(stop[:k]):
                assert k <= len(matcher.pending), (sent, matcher.pending)


def test_a_stop_split_over_three_pieces():
    emitted, matched = run(["the EN", "", "D", " more"], ["END"])
    assert matched and "".join(emitted) == "the "
    assert emitted[0] == "the "  # "EN" was held back


@given(st.text(alphabet=st.sampled_from("ab \n\r\x1c\x85\u2028\u2029é€\U0001f600"), max_size=30))
def test_an_event_is_one_line_for_every_reader_whatever_the_text(text):
    # Generated text may hold characters that str.splitlines and httpx's line reader
    # take for line breaks (U+0085, U+2028, U+2029): the event must stay one line.
    event = sse({"choices": [{"text": text}]})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    line = event[:-2].decode()
    assert line.splitlines() == [line]
    assert json.loads(line.removeprefix("data: ")) == {"choices": [{"text": text}]}
