"""One HTTP request's engine requests: open them, merge their streams, end them.

A request with ``n`` choices (or several prompts) becomes that many engine
requests with distinct ids. Each engine stream yields batches of
:class:`~iterserve.scheduler.messages.EngineOutput`; a :class:`Choice` turns
them into text deltas (detokenized, stop strings applied). Whatever way the
request ends — finished, stop string, timeout, client gone — :meth:`Generation.close`
cancels every engine stream still open, which aborts its engine request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...scheduler.messages import EngineOutput, PromptLogprobs
from ...scheduler.request import FinishReason
from ..engine.errors import EngineRefusal
from .errors import (
    APIError,
    EngineFailure,
    from_refusal,
    timed_out,
    unavailable,
)
from .stream import StopMatcher

# Reasons whose last token is the one that stopped the sequence (EOS or a stop token id).
STOP_TOKEN_REASONS = frozenset({"eos", "stop_token"})


class EngineStream(Protocol):
    """An accepted engine request: async-iterates batches of its outputs."""

    def __aiter__(self) -> AsyncIterator[list[EngineOutput]]: ...

    def cancel(self) -> None: ...


class EngineClient(Protocol):
    """What the HTTP layer needs from the engine replicas."""

    async def open(
        self, request_id: str, prompt_token_ids: list[int], params: dict, priority: int
    ) -> EngineStream:
        """Queues a request (``request_id`` is its label); raises EngineRefusal
        when the engine refuses it."""

    async def info(self) -> dict:
        """``{"max_model_len", "vocab_size"}`` of the engines."""

    async def stats(self) -> list[dict]:
        """One stats dict per engine replica."""

    async def health(self) -> list[dict]:
        """``{"healthy", "message", "replica"}`` per engine replica."""


@dataclass
class Delta:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list]] = field(default_factory=list)  # (token, lp, top)
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # in the delta that brings them


class Choice:
    """One output sequence: tokens in, text deltas out.

    The token that stopped the sequence (EOS, a stop token id) is counted but not
    written, and a matched stop string is cut, unless ``include_stop_str``. An
    embedding's prompt has no ``detokenizer`` (None): no token is sampled, its
    last output brings the ``pooled`` vector.
    """

    def __init__(
        self,
        index: int,
        detokenizer: Any,
        stops: Sequence[str],
        logprobs: bool,
        include_stop_str: bool = False,
    ):
        self.index = index
        self.detokenizer = detokenizer
        self.matcher = StopMatcher(stops, include_stop=include_stop_str)
        self.include_stop_str = include_stop_str
        self.want_logprobs = logprobs
        self.num_tokens = 0
        self.text = ""
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        self.prompt_logprobs: PromptLogprobs | None = None
        self.num_cached_tokens: int | None = None  # prompt tokens the prefix cache held
        self.pooled: list[float] | None = None  # a pooling engine's vector of the prompt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def consume(self, outputs: list[EngineOutput]) -> Delta:
        delta = Delta()
        for out in outputs:
            token_ids, logprobs, reason = out.token_ids, out.logprobs, out.finish_reason
            if reason == "error":
                raise EngineFailure(out.error or "the engine failed this request")
            if out.num_cached_tokens is not None:
                self.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:  # once, with the prompt's last piece
                delta.prompt_logprobs = self.prompt_logprobs = out.prompt_logprobs
            unwritten = -1  # position of the stopping token, when it is left out of the text
            if reason in STOP_TOKEN_REASONS and not self.include_stop_str:
                unwritten = len(token_ids) - 1
            for pos, token_id in enumerate(token_ids):
                self.num_tokens += 1
                delta.token_ids.append(token_id)
                if self.want_logprobs and pos < len(logprobs):
                    logprob, top = logprobs[pos]
                    delta.logprobs.append((token_id, logprob, top))
                if pos == unwritten:
                    continue
                if self._emit(delta, self.detokenizer.add(token_id)):
                    return delta
            if reason is not None:
                if out.pooled is not None:
                    self.pooled = out.pooled
                tail = self.detokenizer.flush() if self.detokenizer is not None else ""
                if not self._emit(delta, tail):
                    text, matched = self.matcher.flush()
                    self._add_text(delta, text)
                    self.stopped_by_string = matched
                    self.finish_reason = "stop" if matched else FinishReason(reason).openai
                    delta.finish_reason = self.finish_reason
                return delta
        return delta

    def _emit(self, delta: Delta, text: str) -> bool:
        """Passes new text through the stop matcher; True once a stop string matched."""
        if not text:
            return False
        safe, matched = self.matcher.feed(text)
        self._add_text(delta, safe)
        if matched:
            self.stopped_by_string = True
            self.finish_reason = delta.finish_reason = "stop"
        return matched

    def _add_text(self, delta: Delta, text: str) -> None:
        delta.text += text
        self.text += text


@dataclass
class Job:
    request_id: str
    prompt_token_ids: list[int]
    params: dict
    priority: int
    choice: Choice


class Generation:
    """The engine requests of one HTTP request, merged into one stream of deltas."""

    def __init__(self, engine: EngineClient, jobs: list[Job], timeout_s: float | None):
        self.engine = engine
        self.jobs = jobs
        self.timeout_s = timeout_s
        loop = asyncio.get_running_loop()
        self.deadline = None if timeout_s is None else loop.time() + timeout_s
        self.streams: list[EngineStream] = []
        self.tasks: list[asyncio.Task] = []
        self.open_streams: set[int] = set()
        self.expired = False  # the request timeout fired

    def _remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    async def open(self) -> None:
        """Queues every engine request; on any refusal, cancels the others and raises.
        However opening ends early (a refusal, the request timeout, the client going
        away while it waits), every engine request it opened is cancelled."""
        loop = asyncio.get_running_loop()
        opens = [
            loop.create_task(
                self.engine.open(j.request_id, j.prompt_token_ids, j.params, j.priority)
            )
            for j in self.jobs
        ]
        try:
            done, pending = await asyncio.wait(
                opens, timeout=self._remaining(), return_when=asyncio.FIRST_EXCEPTION
            )
        except BaseException:  # cancelled: the client went away
            _abandon(opens)
            raise
        failed = [t.exception() for t in done if t.exception() is not None]
        if failed or pending:
            _abandon(opens)
            raise _as_api_error(failed[0]) if failed else timed_out(self.timeout_s)
        self.streams = [t.result() for t in opens]
        self.open_streams = set(range(len(self.streams)))

    async def deltas(self) -> AsyncIterator[tuple[Choice, Delta]]:
        """Deltas of every choice as they come. Raises APIError (timeout, engine failure).

        The request timeout is one timer for the whole generation: when it fires it
        cancels the streams, which ends them unfinished. One engine request (the
        common case) is read in this task; several are merged through a queue."""
        loop = asyncio.get_running_loop()
        timer = None if self.deadline is None else loop.call_at(self.deadline, self._expire)
        try:
            if len(self.streams) == 1:
                async for outputs in self.streams[0]:
                    delta = self._consume(0, outputs)
                    if delta is not None:
                        yield delta
                self._ended(0, None)
            else:
                async for delta in self._merged():
                    yield delta
        finally:
            if timer is not None:
                timer.cancel()

    async def _merged(self) -> AsyncIterator[tuple[Choice, Delta]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: EngineStream) -> None:
            try:
                async for outputs in stream:
                    queue.put_nowait((i, outputs, None))
                queue.put_nowait((i, None, None))
            except Exception as exc:  # the replica died or the call failed
                queue.put_nowait((i, None, exc))

        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        while self.open_streams:
            i, outputs, exc = await queue.get()
            if outputs is None:
                self._ended(i, exc)
                continue
            delta = self._consume(i, outputs)
            if delta is not None:
                yield delta

    def _consume(self, i: int, outputs: list[EngineOutput]) -> tuple[Choice, Delta] | None:
        if i not in self.open_streams:
            return None  # after a stop string: the stream was cancelled
        choice = self.jobs[i].choice
        try:
            delta = choice.consume(outputs)
        except EngineFailure as failure:
            raise unavailable(str(failure)) from None
        if choice.stopped_by_string:
            self._cancel(i)  # aborts the engine request
        elif choice.finished:
            self.open_streams.discard(i)
        return choice, delta

    def _ended(self, i: int, exc: BaseException | None) -> None:
        """Stream ``i`` has no more outputs; unless its choice finished, that is the
        timeout's doing or a lost engine request."""
        if self.expired:
            raise timed_out(self.timeout_s)
        was_open = i in self.open_streams
        self.open_streams.discard(i)
        if was_open and (exc is not None or not self.jobs[i].choice.finished):
            raise unavailable(f"the engine lost the request: {exc or 'stream ended'}")

    def _expire(self) -> None:
        self.expired = True
        for i in list(self.open_streams):
            self.streams[i].cancel()

    def _cancel(self, i: int) -> None:
        self.open_streams.discard(i)
        self.streams[i].cancel()
        if i < len(self.tasks):
            self.tasks[i].cancel()

    def close(self) -> None:
        """Cancels every stream still open (client gone, timeout, error)."""
        for i in list(self.open_streams):
            self._cancel(i)
        for task in self.tasks:
            task.cancel()


def _abandon(opens: list[asyncio.Task]) -> None:
    """Ends every engine request of ``opens``: an accepted one is cancelled (which
    aborts it on the engine), an open still waiting is cancelled itself (the
    engine client then aborts whatever it had queued)."""
    for task in opens:
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None:
            task.result().cancel()


def _as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineRefusal):
        return from_refusal(exc)
    return unavailable(f"{type(exc).__name__}: {exc}")
