"""Opening the engine requests of one HTTP request (``n`` choices, several prompts):
however the opening ends (a refusal, the request timeout, the client hanging up
part-way), no engine request it opened is left running."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.cluster.engine.errors import EngineBusyError
from iterserve.cluster.openai.errors import APIError
from iterserve.cluster.openai.generation import Generation, Job

NEVER = -1  # an open that is not answered before the request ends


class StubStream:
    def __init__(self):
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class StubEngine:
    """Answers job ``i``'s open after ``turns[i]`` turns of the event loop (NEVER:
    not before it is cancelled); ``refuse`` names the jobs it refuses."""

    def __init__(self, turns: list[int], refuse: set[int] = frozenset()):
        self.turns = turns
        self.refuse = refuse
        self.streams: list[StubStream] = []  # every accepted request, running until cancelled
        self.waiting = 0  # opens not answered yet

    async def open(self, request_id, prompt_token_ids, params, priority):
        i = int(request_id.rsplit("-", 1)[1])
        self.waiting += 1
        try:
            if self.turns[i] == NEVER:
                await asyncio.Event().wait()
            for _ in range(self.turns[i]):
                await asyncio.sleep(0)
        finally:
            self.waiting -= 1
        if i in self.refuse:
            raise EngineBusyError("the waiting queue is full")
        stream = StubStream()
        self.streams.append(stream)
        return stream


def _jobs(n: int) -> list[Job]:
    return [Job(f"req-{i}", [1, 2], {}, 0, None) for i in range(n)]


def _nothing_left_running(engine: StubEngine) -> bool:
    return engine.waiting == 0 and all(s.cancelled for s in engine.streams)


async def test_a_client_that_hangs_up_while_choices_open_leaves_none_running():
    engine = StubEngine([0, 0, NEVER, 3])
    generation = Generation(engine, _jobs(4), timeout_s=None)
    opening = asyncio.ensure_future(generation.open())
    for _ in range(2):  # the first two are accepted, the others not yet
        await asyncio.sleep(0)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    await asyncio.sleep(0)
    assert len(engine.streams) >= 2 and _nothing_left_running(engine)


async def test_a_request_timeout_while_choices_open_leaves_none_running():
    engine = StubEngine([0, NEVER, 1])
    generation = Generation(engine, _jobs(3), timeout_s=0.01)
    with pytest.raises(APIError) as error:
        await generation.open()
    assert error.value.status == 504
    await asyncio.sleep(0)
    assert len(engine.streams) == 2 and _nothing_left_running(engine)


@settings(max_examples=150, deadline=None)
@given(
    turns=st.lists(st.one_of(st.just(NEVER), st.integers(0, 4)), min_size=1, max_size=8),
    refuse=st.sets(st.integers(0, 7), max_size=2),
    hang_up_after=st.one_of(st.none(), st.integers(0, 6)),
)
def test_however_opening_ends_no_engine_request_is_left_running(turns, refuse, hang_up_after):
    """Drawn: when each choice's open is answered (or never), which are refused,
    and when the client hangs up (or not: then the request timeout ends it if an
    open never returns)."""

    async def scenario():
        engine = StubEngine(turns, {i for i in refuse if i < len(turns)})
        generation = Generation(engine, _jobs(len(turns)), timeout_s=0.05)
        opening = asyncio.ensure_future(generation.open())
        if hang_up_after is not None:
            for _ in range(hang_up_after):
                await asyncio.sleep(0)
            opening.cancel()
        try:
            await opening
        except (asyncio.CancelledError, APIError):
            pass
        else:  # every choice was accepted: the generation owns them, close() ends them
            generation.close()
        await asyncio.sleep(0)
        return engine

    engine = asyncio.run(scenario())
    assert _nothing_left_running(engine)
