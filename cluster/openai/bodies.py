"""Response bodies and stream chunks of /v1/completions and /v1/chat/completions in
OpenAI's shapes (plain dicts, no models: one chunk per streamed batch must stay
cheap). The Responses API's own bodies and events are :mod:`.responses`'."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .generation import Choice, Delta
from .reasoning import ReasoningText, Split
from .tool_parsers import Parsed, ToolCall, ToolCallParser


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` (prompt tokens
    the prefix cache held) once the engine has said."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def cached_prompt_tokens(choices: list[Choice], n: int) -> int | None:
    """Cached tokens of the request's prompts, each counted once as its tokens are
    (by its first choice that reported any: the ``n`` choices of a prompt are
    separate engine requests, and the later ones may find what the first computed)."""
    per_prompt: dict[int, int] = {}
    for choice in sorted(choices, key=lambda c: c.index):
        if choice.num_cached_tokens is not None:
            per_prompt.setdefault(choice.index // n, choice.num_cached_tokens)
    return sum(per_prompt.values()) if per_prompt else None


class ChatText:
    """One chat choice's text as the client reads it: reasoning, when a reasoning
    parser splits it off (``reasoning``), then content, and tool calls when a
    parser reads them out of the answer. ``max_calls``: calls beyond it are
    dropped (``parallel_tool_calls: false``)."""

    def __init__(
        self,
        parser: ToolCallParser | None,
        max_calls: int | None = None,
        reasoning: ReasoningText | None = None,
    ):
        self.parser = parser
        self.max_calls = max_calls
        self.reasoning = reasoning
        self.calls: list[ToolCall] = []
        self.started = False  # a stream's first chunk of this choice carries the role
        self.show_reasoning = True  # false: split off, not shown (include_reasoning: false)

    def feed(self, text: str, finished: bool) -> Parsed:
        thought = ""
        if self.reasoning is not None:
            split = self.reasoning.feed(text) if text else Split()
            if finished:
                split += self.reasoning.finish()
            text, thought = split.content, split.reasoning
        if self.parser is None:
            return Parsed(text, reasoning=thought)
        out = self.parser.feed(text) if text else Parsed()
        if finished:
            out += self.parser.finish()
        room = None if self.max_calls is None else max(0, self.max_calls - len(self.calls))
        out.calls = out.calls[:room]
        out.reasoning = thought
        self.calls += out.calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        # As OpenAI and vLLM answer: a choice that called a tool finished to do so;
        # unless max_tokens cut it, which the client must know (calls may be missing).
        return "tool_calls" if reason not in (None, "length") and self.calls else reason


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, written before its text (``echo``): the prompt's
    text and tokens, and with ``logprobs`` (not None) its tokens' logprobs."""

    text: str
    token_ids: list[int]
    logprobs: int | None


class ResponseBuilder:
    """Builds the bodies of one response; ``chat`` selects the chat shapes.

    ``token_text`` writes a token of the logprobs (``return_tokens_as_token_ids``
    writes ids instead); ``continuous_usage``: every stream chunk carries the
    usage so far. ``echoes``: per prompt, what an echoing completion writes
    first (choice ``i`` is of prompt ``i // n``). ``prompt_logprobs``: the
    request asked for them (vLLM's field: per choice in completions, once per
    response in chat), of the prompts whose tokens are ``prompt_ids``.
    """

    def __init__(
        self,
        *,
        chat: bool,
        request_id: str,
        model: str,
        tokenizer: Any,
        tokens_as_ids: bool = False,
        echoes: list[Echo] | None = None,
        n: int = 1,
        prompt_logprobs: bool = False,
        prompt_ids: list[list[int]] | None = None,
    ):
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids
        self.echoes = echoes
        self.n = n
        self.want_prompt_logprobs = prompt_logprobs
        self.prompt_ids = prompt_ids
        self.created = int(time.time())
        self.include_usage_field = False  # stream_options.include_usage: usage on chunks
        self.continuous_usage = False
        self.prompt_tokens = 0
        self._plain: dict[int, ChatText] = {}
        self._echoed: set[int] = set()  # stream: choices whose prompt was written

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        body = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage_field:
            body["usage"] = None
        return body

    # -- streaming --------------------------------------------------------------------

    def chunk(
        self, choice: Choice, delta: Delta, text_offset: int, chat_text: ChatText | None = None
    ) -> dict | None:
        """The chunk for one delta, or None when it has nothing to tell."""
        if self.chat:
            logprobs = self.logprobs(delta.logprobs, text_offset) if choice.want_logprobs else None
            if chat_text is None:  # plain text; kept per choice, which carries its state
                chat_text = self._plain.setdefault(choice.index, ChatText(None))
            body, reason = self._chat_delta(delta, chat_text)
            if not body and reason is None and not delta.logprobs:
                return None
            entry = {"index": choice.index, "delta": body}
            obj = "chat.completion.chunk"
        else:
            text, entries, text_offset = delta.text, delta.logprobs, text_offset
            echo = self._echo(choice)
            if echo is not None:  # the prompt first, in the choice's first chunk
                text_offset += len(echo.text)
                if choice.index not in self._echoed:
                    self._echoed.add(choice.index)
                    text = echo.text + text
                    entries = self._echo_entries(echo, choice) + entries
                    text_offset = 0
            prompt = delta.prompt_logprobs is not None and self.want_prompt_logprobs
            if not (text or delta.finish_reason or entries or prompt):
                return None
            logprobs = self.logprobs(entries, text_offset) if choice.want_logprobs else None
            entry, reason = {"index": choice.index, "text": text}, delta.finish_reason
            obj = "text_completion"
        entry["logprobs"] = logprobs
        entry["finish_reason"] = reason
        body = self._envelope(obj, [entry])
        if delta.prompt_logprobs is not None and self.want_prompt_logprobs:
            self._put_prompt_logprobs(body, entry, choice)
        if self.continuous_usage:
            body["usage"] = usage(self.prompt_tokens, choice.num_tokens, choice.num_cached_tokens)
        return body

    def _chat_delta(self, delta: Delta, chat_text: ChatText) -> tuple[dict, str | None]:
        parsed = chat_text.feed(delta.text, delta.finish_reason is not None)
        body: dict[str, Any] = {}
        if not chat_text.started:
            # The role travels with the choice's first tokens, not ahead of them: a
            # client timing its first chunk measures the first token.
            chat_text.started = True
            body = {"role": "assistant", "content": parsed.content}
        elif parsed.content:
            body["content"] = parsed.content
        if parsed.reasoning and chat_text.show_reasoning:
            body["reasoning"] = body["reasoning_content"] = parsed.reasoning
        if parsed.calls:
            first = len(chat_text.calls) - len(parsed.calls)
            body["tool_calls"] = [c.as_dict(first + k) for k, c in enumerate(parsed.calls)]
        return body, chat_text.finish_reason(delta.finish_reason)

    def usage_chunk(self, prompt_tokens: int, choices: list[Choice]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = self._usage(prompt_tokens, choices)
        return body

    # -- whole responses ------------------------------------------------------------

    def response(
        self,
        choices: list[Choice],
        logprobs: dict[int, list],
        prompt_tokens: int,
        chat_text: Callable[[int], ChatText] | None = None,
    ) -> dict:
        entries = []
        body = self._envelope("chat.completion" if self.chat else "text_completion", [])
        for choice in sorted(choices, key=lambda c: c.index):
            token_entries, text = logprobs.get(choice.index, []), choice.text
            echo = None if self.chat else self._echo(choice)
            if echo is not None:
                token_entries = self._echo_entries(echo, choice) + token_entries
                text = echo.text + text
            lp = self.logprobs(token_entries, 0) if choice.want_logprobs else None
            reason = choice.finish_reason
            if self.chat:
                text = chat_text(choice.index) if chat_text else ChatText(None)
                parsed = text.feed(choice.text, finished=True)
                message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
                if text.calls:
                    message["content"] = parsed.content or None
                    message["tool_calls"] = [c.as_dict() for c in text.calls]
                if text.reasoning is not None and text.show_reasoning:
                    # vLLM's field, and its older name, both kept for the clients of each
                    message["reasoning"] = message["reasoning_content"] = parsed.reasoning or None
                    message["content"] = parsed.content or None
                entry = {"index": choice.index, "message": message}
                reason = text.finish_reason(reason)
            else:
                entry = {"index": choice.index, "text": text}
            entry["logprobs"] = lp
            entry["finish_reason"] = reason
            if self.want_prompt_logprobs:
                self._put_prompt_logprobs(body, entry, choice)
            entries.append(entry)
        body["choices"] = entries
        body["usage"] = self._usage(prompt_tokens, choices)
        return body

    def _usage(self, prompt_tokens: int, choices: list[Choice]) -> dict:
        """The whole request's usage: every choice's tokens, each prompt's cache hits."""
        completion_tokens = sum(c.num_tokens for c in choices)
        return usage(prompt_tokens, completion_tokens, cached_prompt_tokens(choices, self.n))

    # -- echo and prompt logprobs ------------------------------------------------------

    def _echo(self, choice: Choice) -> Echo | None:
        return None if self.echoes is None else self.echoes[choice.index // self.n]

    def _echo_entries(self, echo: Echo, choice: Choice) -> list[tuple]:
        """The prompt's tokens as logprob entries (the first has no logprob)."""
        if echo.logprobs is None:
            return []
        prompt = choice.prompt_logprobs
        entries: list[tuple] = [(echo.token_ids[0], None, None)]
        for i, token_id in enumerate(echo.token_ids[1:]):
            if prompt is None or i >= len(prompt.token_logprobs):
                entries.append((token_id, None, None))
                continue
            top = prompt.top_logprobs[i][: echo.logprobs]
            entries.append((token_id, prompt.token_logprobs[i], top))
        return entries

    def _put_prompt_logprobs(self, body: dict, entry: dict, choice: Choice) -> None:
        """vLLM's ``prompt_logprobs``: None for the first token, then per token a map
        of token id -> ``{logprob, rank, decoded_token}``, the prompt's own token
        and its top alternatives. Chat has one per response (its first choice's)."""
        prompt = choice.prompt_logprobs
        if self.chat and (choice.index != 0 or "prompt_logprobs" in body):
            return
        value = None
        if prompt is not None:
            echo_ids = self._prompt_ids(choice)
            value = [None]
            for i, logprob in enumerate(prompt.token_logprobs):
                step = {}
                if echo_ids is not None and i + 1 < len(echo_ids):
                    step[str(echo_ids[i + 1])] = self._logprob(echo_ids[i + 1], logprob,
                                                               prompt.ranks[i])  # fmt: skip
                for rank, (alt, alt_lp) in enumerate(prompt.top_logprobs[i], start=1):
                    step.setdefault(str(alt), self._logprob(alt, alt_lp, rank))
                value.append(step)
        (body if self.chat else entry)["prompt_logprobs"] = value

    def _prompt_ids(self, choice: Choice) -> list[int] | None:
        return self.prompt_ids[choice.index // self.n] if self.prompt_ids else None

    def _logprob(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self._token_text(token_id)}

    # -- logprobs -------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs(self, entries: list[tuple[int, float, list]], text_offset: int) -> dict:
        if self.chat:
            content = []
            for token_id, logprob, top in entries:
                text = self._token_text(token_id)
                content.append(
                    {
                        "token": text,
                        "logprob": logprob,
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {
                                "token": (t := self._token_text(alt)),
                                "logprob": alt_lp,
                                "bytes": list(t.encode()),
                            }
                            for alt, alt_lp in top
                        ],
                    }
                )
            return {"content": content, "refusal": None}
        tokens, offsets = [], []
        for token_id, _, _ in entries:
            offsets.append(text_offset)
            text_offset += len(self.tokenizer.decode([token_id], skip_special_tokens=False))
            tokens.append(self._token_text(token_id))
        return {
            "tokens": tokens,
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [  # an echoed prompt's first token has none (None)
                None if top is None else {self._token_text(alt): alt_lp for alt, alt_lp in top}
                for _, _, top in entries
            ],
            "text_offset": offsets,
        }
