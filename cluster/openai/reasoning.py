"""Reasoning output: a thinking model's ``<think>…</think>`` block, split from its answer.

With ``reasoning_parser`` set, what the model writes inside the block is the
message's ``reasoning`` (and ``reasoning_content``, vLLM's older name) in chat,
and a reasoning item in the Responses API; what follows it is the answer, the
only text read for tool calls. Structured outputs constrain the answer only:
the ranks start a request's grammar after its ``</think>`` token
(``StructuredOutput.start_after``).

===============  ==============================================================
parser           where the reasoning is
===============  ==============================================================
``qwen3``        inside ``<think>…</think>``: opened by the output's first
                 token, or left open by the prompt (the thinking templates end
                 in ``<think>``). An output that opens no block is all answer.
``deepseek_r1``  everything before ``</think>``: the model always thinks first
                 (its template may open the block; a ``<think>`` the model
                 writes itself is dropped).
===============  ==============================================================

Either way a prompt that ends in ``</think>`` (Qwen3's ``enable_thinking:
false`` closes an empty block) leaves nothing to think: the output is all
answer. An output cut short inside the block (``max_tokens``) is all reasoning.
The answer starts after the blank lines that follow ``</think>``.

The tags must be single tokens of the vocabulary (they are in Qwen3's and the
DeepSeek-R1 distillations'): a server started with a parser whose tags the
tokenizer lacks refuses to start, naming them. The text is read as it streams
in, the end of a text that may be the start of a tag held back, so a whole
response is the same parser fed the whole text at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"
UNDECIDED, REASONING, ANSWER = "undecided", "reasoning", "answer"


@dataclass
class Split:
    """A piece of output: what of it is reasoning, and what is the answer."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


def _proper_prefix(text: str, tag: str) -> bool:
    return len(text) < len(tag) and tag.startswith(text)


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningText:
    """One choice's output split as it streams in (``feed`` pieces, then ``finish``),
    and its reasoning tokens counted (``count``)."""

    tags = (START, END)  # the detokenizer must keep them even when they are special

    def __init__(self, state: str, start_id: int, end_id: int):
        self.state = state
        self.start_id, self.end_id = start_id, end_id
        self.buffer = ""
        self.leading = True  # nothing but whitespace read of the current part yet
        # Token-level state for the count: the same rules, read on token ids.
        self._token_state = state
        self.num_reasoning_tokens = 0

    def feed(self, text: str) -> Split:
        self.buffer += text
        out = Split()
        while self.buffer:
            if self.state == UNDECIDED:
                head = self.buffer.lstrip()
                if not head or _proper_prefix(head, START):
                    return out  # spaces, or what may become <think>: undecided
                if head.startswith(START):
                    self.state, self.buffer, self.leading = REASONING, head[len(START) :], True
                else:
                    self.state, self.leading = ANSWER, False
            elif self.state == REASONING:
                if self.leading:  # a <think> the model writes itself, and spaces, dropped
                    head = self.buffer.lstrip()
                    if not head or _proper_prefix(head, START):
                        return out
                    if head.startswith(START):
                        self.buffer = head[len(START) :]
                        continue
                    self.buffer, self.leading = head, False
                end = self.buffer.find(END)
                if end < 0:
                    keep = _partial_tag_len(self.buffer, END)
                    out.reasoning += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return out
                out.reasoning += self.buffer[:end]
                self.buffer = self.buffer[end + len(END) :]
                self.state, self.leading = ANSWER, True
            else:
                if self.leading:  # the blank lines after </think> are not the answer's
                    self.buffer = self.buffer.lstrip()
                    if not self.buffer:
                        return out
                    self.leading = False
                out.content += self.buffer
                self.buffer = ""
        return out

    def finish(self) -> Split:
        """The held-back end: a partial tag is text after all."""
        text, self.buffer = self.buffer, ""
        if self.state == REASONING:
            return Split(reasoning=text.lstrip() if self.leading else text)
        return Split(content="" if self.leading and self.state == ANSWER else text)

    def count(self, token_ids: Iterable[int]) -> None:
        """Counts the output tokens that belong to the reasoning, tags included."""
        for token_id in token_ids:
            if self._token_state == UNDECIDED:
                self._token_state = REASONING if token_id == self.start_id else ANSWER
            if self._token_state != REASONING:
                return
            self.num_reasoning_tokens += 1
            if token_id == self.end_id:
                self._token_state = ANSWER


@dataclass(frozen=True)
class ReasoningParser:
    """A server's reasoning parser: makes each choice's :class:`ReasoningText`.

    ``thinks_first``: without a tag at the prompt's end, the output starts in
    the reasoning (deepseek_r1) rather than undecided (qwen3).
    """

    name: str
    thinks_first: bool
    start_id: int
    end_id: int

    def initial_state(self, prompt: str) -> str:
        tail = prompt.rstrip()
        if tail.endswith(END):
            return ANSWER
        if tail.endswith(START) or self.thinks_first:
            return REASONING
        return UNDECIDED

    def text(self, prompt: str) -> ReasoningText:
        """A choice's reader, for a prompt whose text is ``prompt``."""
        return ReasoningText(self.initial_state(prompt), self.start_id, self.end_id)

    def grammar_start(self, prompt: str) -> int | None:
        """The token after which a grammar applies (``</think>``), or None when the
        prompt closed the block and the output is all answer."""
        return None if self.initial_state(prompt) == ANSWER else self.end_id


REASONING_PARSERS = {"qwen3": False, "deepseek_r1": True}  # name -> thinks first


def reasoning_parser(name: str | None, tokenizer: Any) -> ReasoningParser | None:
    """The parser called ``name`` for this tokenizer; refused (ValueError) when the
    tokenizer does not have its tags as single tokens."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}"
        )
    ids = []
    for tag in (START, END):
        token_id = tokenizer.token_to_id(tag)
        if token_id is None:
            raise ValueError(
                f"reasoning_parser {name}: this model's tokenizer has no {tag} token, so its "
                "output holds no reasoning block to split"
            )
        ids.append(token_id)
    return ReasoningParser(name, REASONING_PARSERS[name], ids[0], ids[1])
