"""Response bodies and stream chunks in OpenAI's shapes (plain dicts, no models:
one chunk per streamed batch must stay cheap)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from iterserve.cluster.openai.generation import Choice, Delta
from iterserve.cluster.openai.tool_parsers import Parsed, ToolCall, ToolCallParser


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ChatText:
    """One chat choice's text as the client reads it: content, and tool calls when
    a parser reads them out of the text. ``max_calls``: calls beyond it are dropped
    (``parallel_tool_calls: false``)."""

    def __init__(self, parser: ToolCallParser | None, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self.started = False  # a stream's first chunk of this choice carries the role

    def feed(self, text: str, finished: bool) -> Parsed:
        if self.parser is None:
            return Parsed(text)
        out = self.parser.feed(text) if text else Parsed()
        if finished:
            out += self.parser.finish()
        room = None if self.max_calls is None else max(0, self.max_calls - len(self.calls))
        out.calls = out.calls[:room]
        self.calls += out.calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        # As OpenAI and vLLM answer: a choice that called a tool finished to do so.
        return "tool_calls" if reason is not None and self.calls else reason


class ResponseBuilder:
    """Builds the bodies of one response; ``chat`` selects the chat shapes.

    ``token_text`` writes a token of the logprobs (``return_tokens_as_token_ids``
    writes ids instead); ``continuous_usage``: every stream chunk carries the
    usage so far.
    """

    def __init__(
        self,
        *,
        chat: bool,
        request_id: str,
        model: str,
        tokenizer: Any,
        tokens_as_ids: bool = False,
    ):
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids
        self.created = int(time.time())
        self.include_usage_field = False  # stream_options.include_usage: usage on chunks
        self.continuous_usage = False
        self.prompt_tokens = 0
        self._plain: dict[int, ChatText] = {}

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
        logprobs = self.logprobs(delta.logprobs, text_offset) if choice.want_logprobs else None
        if self.chat:
            if chat_text is None:  # plain text; kept per choice, which carries its state
                chat_text = self._plain.setdefault(choice.index, ChatText(None))
            body, reason = self._chat_delta(delta, chat_text)
            if not body and reason is None and not delta.logprobs:
                return None
            entry = {"index": choice.index, "delta": body}
            obj = "chat.completion.chunk"
        else:
            if not (delta.text or delta.finish_reason or delta.logprobs):
                return None
            entry, reason = {"index": choice.index, "text": delta.text}, delta.finish_reason
            obj = "text_completion"
        entry["logprobs"] = logprobs
        entry["finish_reason"] = reason
        body = self._envelope(obj, [entry])
        if self.continuous_usage:
            body["usage"] = usage(self.prompt_tokens, choice.num_tokens)
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
        if parsed.calls:
            first = len(chat_text.calls) - len(parsed.calls)
            body["tool_calls"] = [c.as_dict(first + k) for k, c in enumerate(parsed.calls)]
        return body, chat_text.finish_reason(delta.finish_reason)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
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
        for choice in sorted(choices, key=lambda c: c.index):
            lp = self.logprobs(logprobs.get(choice.index, []), 0) if choice.want_logprobs else None
            reason = choice.finish_reason
            if self.chat:
                text = chat_text(choice.index) if chat_text else ChatText(None)
                parsed = text.feed(choice.text, finished=True)
                message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
                if text.calls:
                    message["content"] = parsed.content or None
                    message["tool_calls"] = [c.as_dict() for c in text.calls]
                entry = {"index": choice.index, "message": message}
                reason = text.finish_reason(reason)
            else:
                entry = {"index": choice.index, "text": choice.text}
            entry["logprobs"] = lp
            entry["finish_reason"] = reason
            entries.append(entry)
        body = self._envelope("chat.completion" if self.chat else "text_completion", entries)
        body["usage"] = usage(prompt_tokens, sum(c.num_tokens for c in choices))
        return body

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
            "top_logprobs": [
                {self._token_text(alt): alt_lp for alt, alt_lp in top} for _, _, top in entries
            ],
            "text_offset": offsets,
        }
