"""Tool calls in a model's text, found whole or while the text streams in.

A parser turns one choice's text, fed in pieces, into content and tool calls.
It hands out a call only once the call's JSON is complete and valid, so a
streaming client never receives a call that turns out to be broken; text that
looked like a call but is not one stays content. A whole response is the same
parser fed the whole text at once (:func:`parse_whole`), so streamed and whole
answers agree by construction.

=============  ================================================================
parser         what the model writes
=============  ================================================================
``hermes``     ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any
               number of them, text before them (Hermes, Qwen 2.5 and 3)
``llama3_json``  ``{"name": "f", "parameters": {...}}``, possibly after
               ``<|python_tag|>``, several separated by ``;``: the whole output
               is calls or it is content (Llama 3.1-3.3 with JSON tool calling)
=============  ================================================================

Two more serve ``tool_choice`` values that constrain the output to a schema (a
call is then always what the model writes): :class:`JsonArrayParser` (a JSON
list of ``{"name", "parameters"}``, for ``required``) and :class:`NamedParser`
(the arguments object alone, for one named function).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        body = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return body if index is None else {"index": index, **body}


@dataclass
class Parsed:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""  # what a reasoning parser read out before the answer (reasoning.py)

    def __add__(self, other: Parsed) -> Parsed:
        return Parsed(
            self.content + other.content,
            self.calls + other.calls,
            self.reasoning + other.reasoning,
        )


class ToolCallParser(Protocol):
    """One choice's parser: fed text pieces in order, then finished once."""

    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed: ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments(value: Any) -> str | None:
    """Arguments as JSON object text; some models write the object as a string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj: Any) -> ToolCall | None:
    """``{"name": ..., "arguments" | "parameters": {...}}`` as a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    raw = obj.get("arguments", obj.get("parameters", {}))
    arguments = _arguments(raw)
    return None if arguments is None else ToolCall(new_call_id(), obj["name"], arguments)


def _call_from_text(text: str) -> ToolCall | None:
    try:
        return call_from_object(json.loads(text))
    except ValueError:
        return None


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def parse_whole(parser: ToolCallParser, text: str) -> Parsed:
    return parser.feed(text) + parser.finish()


class HermesParser:
    """``<tool_call>JSON</tool_call>`` blocks anywhere in the text.

    Outside a block, text is content, except the tail that could be the start of
    ``<tool_call>`` (held back, like a stop string's start). Inside one, text is
    held until ``</tool_call>``. Once a call was made, whitespace between and
    after the blocks is the format's, not content.
    """

    START, END = "<tool_call>", "</tool_call>"
    # Tokens that must survive detokenizing: some tokenizers mark them special.
    tags = (START, END)

    def __init__(self) -> None:
        self.buffer = ""
        self.inside = False
        self.made_call = False
        self.held = ""  # whitespace after a call, sent only if real text follows

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        while True:
            if not self.inside:
                start = self.buffer.find(self.START)
                if start < 0:
                    keep = _partial_tag_len(self.buffer, self.START)
                    self._content(out, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return out
                self._content(out, self.buffer[:start])
                self.held = ""
                self.buffer = self.buffer[start + len(self.START) :]
                self.inside = True
            else:
                end = self.buffer.find(self.END)
                if end < 0:
                    return out
                body, self.buffer = self.buffer[:end], self.buffer[end + len(self.END) :]
                self.inside = False
                self._block(out, body, closed=True)

    def finish(self) -> Parsed:
        out = Parsed()
        if self.inside:  # ended inside a block (EOS or a stop string took the end tag)
            self._block(out, self.buffer, closed=False)
        else:
            self._content(out, self.buffer)
        self.buffer, self.inside, self.held = "", False, ""
        return out

    def _block(self, out: Parsed, body: str, *, closed: bool) -> None:
        call = _call_from_text(body.strip())
        if call is None:
            self._content(out, self.START + body + (self.END if closed else ""))
        else:
            out.calls.append(call)
            self.made_call = True

    def _content(self, out: Parsed, text: str) -> None:
        if not self.made_call:
            out.content += text
            return
        self.held += text
        if self.held.strip():
            out.content += self.held
            self.held = ""


class Llama3JsonParser:
    """The whole output is one or more JSON calls, or it is content.

    The first non-space characters decide: ``{`` or ``<|python_tag|>`` start
    calls, and everything is held to the end, where it is parsed as calls
    separated by ``;`` (content after all, if it is not exactly that); anything
    else is content, sent as it comes.
    """

    TAG = "<|python_tag|>"
    tags = ()  # it reads calls without the tag too: nothing needs keeping

    def __init__(self) -> None:
        self.buffer = ""
        self.mode: str | None = None  # None: undecided, "text" or "calls"

    def feed(self, text: str) -> Parsed:
        if self.mode == "text":
            return Parsed(text)
        self.buffer += text
        if self.mode == "calls":
            return Parsed()
        head = self.buffer.lstrip()
        if not head or (self.TAG.startswith(head) and head != self.TAG):
            return Parsed()  # only spaces, or what may become the tag: undecided
        if head.startswith(("{", self.TAG)):
            self.mode = "calls"
            return Parsed()
        self.mode = "text"
        text, self.buffer = self.buffer, ""
        return Parsed(text)

    def finish(self) -> Parsed:
        text, self.buffer = self.buffer, ""
        if self.mode == "calls":
            calls = self._calls(text)
            if calls:
                return Parsed(calls=calls)
        return Parsed(text)

    def _calls(self, text: str) -> list[ToolCall] | None:
        text = text.strip().removeprefix(self.TAG)
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            call = call_from_object(obj)
            if call is None:
                return None
            calls.append(call)
            rest = text[pos:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            pos = len(text) - len(rest) + 1


class JsonArrayParser:
    """A JSON list of ``{"name", "parameters"}``: what ``tool_choice: required``
    constrains the output to. Each element is a call the moment its JSON is
    complete, so calls stream one by one, and an output cut short (``max_tokens``)
    keeps the calls it completed; the cut one is dropped. Text that turns out not
    to be such a list is content, from where it stops being one."""

    tags = ()

    def __init__(self) -> None:
        self.text = ""  # everything fed
        self.read = 0  # how much of it was read as the list so far
        self.opened = self.closed = self.broken = False
        self.made_call = False
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> Parsed:
        self.text += text
        return Parsed(calls=self._complete_calls())

    def _complete_calls(self) -> list[ToolCall]:
        calls: list[ToolCall] = []
        text = self.text
        while not (self.broken or self.closed):
            pos = self.read
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos == len(text):
                break
            if not self.opened:
                self.opened, self.broken = text[pos] == "[", text[pos] != "["
                self.read = pos + 1
                continue
            if text[pos] in ",]":
                self.closed = text[pos] == "]"
                self.read = pos + 1
                continue
            try:
                obj, end = self._decoder.raw_decode(text, pos)
            except ValueError:
                break  # not complete yet (or never: the end decides)
            call = call_from_object(obj)
            if call is None:
                self.broken = True
                break
            calls.append(call)
            self.made_call = True
            self.read = end
        return calls

    def finish(self) -> Parsed:
        text, read = self.text, self.read
        self.text, self.read = "", 0
        if not self.made_call and (self.broken or self.closed):
            return Parsed(text)  # complete JSON, but no call in it ("[]", an object)
        if self.broken:
            return Parsed(text[read:].strip())
        return Parsed()  # a call cut short, or nothing but the list's punctuation


class NamedParser:
    """The arguments object of one named function: what a named ``tool_choice``
    constrains the output to."""

    tags = ()

    def __init__(self, name: str) -> None:
        self.name = name
        self.buffer = ""

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        return Parsed()

    def finish(self) -> Parsed:
        text, self.buffer = self.buffer, ""
        call = call_from_object({"name": self.name, "arguments": text.strip() or "{}"})
        return Parsed(text) if call is None else Parsed(calls=[call])


# The parsers a server can be started with (``tool_call_parser``), for tool_choice "auto".
TOOL_CALL_PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
