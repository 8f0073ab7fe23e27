"""A response's output items, and the typed events that stream them.

Output is read as chat output is (:class:`~iterserve.cluster.openai.bodies.ChatText`):
reasoning (with a reasoning parser), the answer's text, and the function calls
a tool-call parser reads out of the answer. Each becomes an output item, in the
order it starts: a ``reasoning`` item, a ``message`` with one ``output_text``
part, a ``function_call`` per call. Streamed, every item is announced, filled
and closed by its events, each with the next ``sequence_number``::

    response.created, response.in_progress
    response.output_item.added           (reasoning)
      response.content_part.added        (reasoning_text)
      response.reasoning_text.delta ...  response.reasoning_text.done
      response.content_part.done         response.output_item.done
    response.output_item.added           (message)
      response.content_part.added        (output_text)
      response.output_text.delta ...     response.output_text.done
      response.content_part.done         response.output_item.done
    response.output_item.added           (function_call)
      response.function_call_arguments.delta, .done
      response.output_item.done
    response.completed                   (response.incomplete when max_output_tokens cut it)

A call's arguments arrive whole, in one delta: the parser hands a call out only
once its JSON is complete. The reasoning item is closed when the answer starts.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..tool_parsers import Parsed


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    """One response's output items as its text comes in (:meth:`add`), and the
    events that tell a stream so (returned by each call, numbered)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._reasoning: dict[str, Any] | None = None  # the open reasoning item
        self._message: dict[str, Any] | None = None  # the open message item
        self._text: list[str] = []  # the open message's text pieces
        self.sequence_number = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return body

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def add(self, parsed: Parsed) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if parsed.reasoning:
            item = self._reasoning
            if item is None:
                item = self._reasoning = self._open(events, "rs", type="reasoning", summary=[])
                events.append(self._part_event("added", item, _reasoning_part("")))
            item["content"][0]["text"] += parsed.reasoning
            where = self._where(item)
            delta = parsed.reasoning
            events.append(self.event("response.reasoning_text.delta", **where, content_index=0,
                                     delta=delta))  # fmt: skip
        if parsed.content or parsed.calls:
            self._close_reasoning(events, "completed")
        if parsed.content:
            item = self._message
            if item is None:
                item = self._message = self._open(events, "msg", type="message", role="assistant")
                events.append(self._part_event("added", item, _text_part("")))
            self._text.append(parsed.content)
            events.append(self.event("response.output_text.delta", **self._where(item),
                                     content_index=0, delta=parsed.content, logprobs=[]))  # fmt: skip
        for call in parsed.calls:
            item = self._open(events, "fc", type="function_call", call_id=call.id,
                              name=call.name, arguments="")  # fmt: skip
            where = self._where(item)
            item["arguments"] = call.arguments
            events.append(self.event("response.function_call_arguments.delta", **where,
                                     delta=call.arguments))  # fmt: skip
            events.append(self.event("response.function_call_arguments.done", **where,
                                     arguments=call.arguments))  # fmt: skip
            self._close(events, item, "completed")
        return events

    def finish(self, complete: bool) -> list[dict[str, Any]]:
        """Closes what is open (``complete``: false when cut short). An output with
        no item at all gets an empty message, so every response has its text."""
        status = "completed" if complete else "incomplete"
        events: list[dict[str, Any]] = []
        self._close_reasoning(events, status)
        if not self.items:
            self._message = self._open(events, "msg", type="message", role="assistant")
            events.append(self._part_event("added", self._message, _text_part("")))
        item = self._message
        if item is not None:
            text = "".join(self._text)
            where = self._where(item)
            events.append(self.event("response.output_text.done", **where, content_index=0,
                                     text=text, logprobs=[]))  # fmt: skip
            item["content"] = [_text_part(text)]
            events.append(self._part_event("done", item, _text_part(text)))
            self._close(events, item, status)
            self._message = None
        return events

    # -- items --------------------------------------------------------------------

    def _open(self, events: list, prefix: str, **fields: Any) -> dict[str, Any]:
        item = {"id": new_id(prefix), **fields, "status": "in_progress"}
        if fields["type"] != "function_call":
            item["content"] = []
        events.append(self.event("response.output_item.added", output_index=len(self.items),
                                 item=_copy(item)))  # fmt: skip
        if fields["type"] == "reasoning":
            item["content"] = [_reasoning_part("")]
        self.items.append(item)
        return item

    def _part_event(self, verb: str, item: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
        return self.event(f"response.content_part.{verb}", **self._where(item), content_index=0,
                          part=part)  # fmt: skip

    def _close_reasoning(self, events: list, status: str) -> None:
        item = self._reasoning
        if item is None:
            return
        text = item["content"][0]["text"]
        where = self._where(item)
        events.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                 text=text))  # fmt: skip
        events.append(self._part_event("done", item, _reasoning_part(text)))
        self._close(events, item, status)
        self._reasoning = None

    def _close(self, events: list, item: dict[str, Any], status: str) -> None:
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=self.items.index(item),
                                 item=_copy(item)))  # fmt: skip


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands now (an event's snapshot; the item keeps changing)."""
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [dict(part) for part in copied["content"]]
    return copied


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int | None,
          reasoning_tokens: int) -> dict[str, Any]:  # fmt: skip
    """The Responses API's usage object. ``cache_write_tokens`` is 0: the prefix
    cache keeps blocks as a side effect of computing them, nothing is written
    on request."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens or 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def response_body(request, *, response_id: str, model: str, created_at: int, status: str,
                  output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                  tool_choice: Any = "auto") -> dict[str, Any]:  # fmt: skip
    """The response object; the request's settings are echoed as OpenAI's are."""
    form = request.text.format if request.text is not None else None
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {
            "effort": request.reasoning.effort if request.reasoning else None,
            "summary": None,
        },
        "store": request.store,
        "temperature": request.temperature,
        "text": {
            "format": {"type": "text"}
            if form is None
            else form.model_dump(by_alias=True, exclude_none=True)
        },
        "tool_choice": tool_choice,
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
        "top_p": request.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": request.user,
        "metadata": request.metadata or {},
    }
    if status == "completed":
        body["completed_at"] = int(time.time())
    return body
