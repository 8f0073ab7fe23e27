"""Response bodies and stream chunks in OpenAI's shapes (plain dicts, no models:
one chunk per streamed batch must stay cheap)."""

from __future__ import annotations

import time
from typing import Any

from iterserve.cluster.openai.generation import Choice, Delta


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseBuilder:
    """Builds the bodies of one response; ``chat`` selects the chat shapes."""

    def __init__(self, *, chat: bool, request_id: str, model: str, tokenizer: Any):
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.include_usage_field = False  # stream_options.include_usage: usage: null on chunks

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

    def role_chunk(self, index: int) -> dict:
        """Chat streams open each choice with the assistant role."""
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(self, choice: Choice, delta: Delta, text_offset: int) -> dict:
        logprobs = self.logprobs(delta.logprobs, text_offset) if choice.want_logprobs else None
        if self.chat:
            body = {"content": delta.text} if delta.text else {}
            entry = {"index": choice.index, "delta": body}
            obj = "chat.completion.chunk"
        else:
            entry = {"index": choice.index, "text": delta.text}
            obj = "text_completion"
        entry["logprobs"] = logprobs
        entry["finish_reason"] = delta.finish_reason
        return self._envelope(obj, [entry])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    # -- whole responses ------------------------------------------------------------

    def response(
        self, choices: list[Choice], logprobs: dict[int, list], prompt_tokens: int
    ) -> dict:
        entries = []
        for choice in sorted(choices, key=lambda c: c.index):
            lp = self.logprobs(logprobs.get(choice.index, []), 0) if choice.want_logprobs else None
            if self.chat:
                entry = {
                    "index": choice.index,
                    "message": {"role": "assistant", "content": choice.text},
                }
            else:
                entry = {"index": choice.index, "text": choice.text}
            entry["logprobs"] = lp
            entry["finish_reason"] = choice.finish_reason
            entries.append(entry)
        body = self._envelope("chat.completion" if self.chat else "text_completion", entries)
        body["usage"] = usage(prompt_tokens, sum(c.num_tokens for c in choices))
        return body

    # -- logprobs -------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
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
            text = self._token_text(token_id)
            offsets.append(text_offset)
            text_offset += len(text)
            tokens.append(text)
        return {
            "tokens": tokens,
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [
                {self._token_text(alt): alt_lp for alt, alt_lp in top} for _, _, top in entries
            ],
            "text_offset": offsets,
        }
