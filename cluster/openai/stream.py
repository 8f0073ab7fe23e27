"""Stop strings over a stream of text deltas, and Server-Sent Events framing.

Stop strings are matched on detokenized text, so a stop string may span any
number of tokens. While streaming, the tail of the text that could still be the
start of a stop string is held back: the client never sees text that a later
token turns into (part of) a stop string.

    emitted          pending
    ──────────────── ───────
    "the answer is " "EN"      stops=["END"]: "EN" may become "END", hold it
    "the answer is " "ENx"  →  no stop can start here: emit "ENx"
"""

from __future__ import annotations

import json
from collections.abc import Sequence

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 128

SSE_DONE = b"data: [DONE]\n\n"


class StopMatcher:
    """Finds the first stop string in a text that arrives in pieces.

    ``include_stop``: the stop string is part of the text, so nothing is held
    back; the text is cut right after the first stop string to complete.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.pending = ""
        self.tail = ""  # include_stop: the end of the emitted text, where a stop may start
        self.tail_len = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str) -> tuple[str, bool]:
        """Adds text; returns ``(text safe to emit, matched)``. After a match the
        emitted text ends just before the stop string (just after it with
        ``include_stop``) and the matcher is spent."""
        if not self.stops:
            return delta, False
        if self.include_stop:
            return self._feed_including(delta)
        self.pending += delta
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        keep = len(self.pending) - self._held_len()
        if found and min(found) <= keep:
            # No stop still being completed starts before this one: it is the first.
            cut = min(found)
            text, self.pending = self.pending[:cut], ""
            return text, True
        # A stop that may yet complete starts at ``keep`` (before any complete one,
        # as in "ba" with stops "a" and "bab"): hold from there.
        text, self.pending = self.pending[:keep], self.pending[keep:]
        return text, False

    def _feed_including(self, delta: str) -> tuple[str, bool]:
        # No stop was complete before this delta, so the first one to complete ends
        # inside it; it may start in the tail.
        window = self.tail + delta
        ends = [i + len(s) for s in self.stops if (i := window.find(s)) >= 0]
        if ends:
            return window[len(self.tail) : min(ends)], True
        self.tail = window[-self.tail_len :] if self.tail_len else ""
        return delta, False

    def _held_len(self) -> int:
        # The longest suffix of pending that is a proper prefix of some stop string.
        # Every occurrence not yet complete must start inside this suffix.
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:k]):
                    best = k
                    break
        return best

    def flush(self) -> tuple[str, bool]:
        """At the end of the sequence no stop can complete any more: the held-back
        text up to the first stop in it (which a longer candidate had kept
        unconfirmed), or all of it. Returns ``(text, matched)`` as ``feed`` does."""
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        cut = min(found) if found else len(self.pending)
        text, self.pending = self.pending[:cut], ""
        return text, bool(found)


# Characters that JSON leaves raw inside strings but many line readers (Python's
# str.splitlines, httpx's aiter_lines) take for line breaks: escaped, so an event
# is always one line whatever text the model generates.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict, event: str | None = None) -> bytes:
    """One Server-Sent Event carrying a JSON payload, on one line; ``event`` names
    its type (the Responses API's typed events)."""
    text = json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + text.encode() + b"\n\n"
