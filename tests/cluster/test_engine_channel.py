"""The engine channel on its own (no Ray): requests in, each step's outputs out in
one frame, aborts, refusals, the token, and either end going away."""

from __future__ import annotations

import asyncio

import pytest

from iterserve.cluster.engine_channel import (
    EngineConnection,
    EngineEndpoint,
    RefusedError,
    encode,
)
from iterserve.cluster.framing import hello
from iterserve.cluster.outputs import OutputBuffers


class StubCore:
    """What the endpoint needs of an EngineCore."""

    def __init__(self):
        self.outputs = OutputBuffers()
        self.added: list[tuple] = []
        self.aborted: list[str] = []

    async def add_request(self, consumer, key, prompt, params, priority, label):
        if params.get("refuse"):
            return ("queue_full", "the waiting queue is full")
        self.outputs.own(key, consumer)
        self.added.append((key, label, prompt, priority))
        return None

    async def abort(self, key):
        self.aborted.append(key)
        self.outputs.push((key, [], [], "abort", None))

    def publish(self, *records):
        for record in records:
            self.outputs.push(record)


async def _connected(local: bool = True):
    core = StubCore()
    endpoint = EngineEndpoint(core, "127.0.0.1")
    address = await endpoint.start()
    gone = []
    connection = await EngineConnection.connect(
        {**address, "replica": "r0"}, "ingress-a", local, gone.append
    )
    return core, endpoint, connection, gone


async def _batches(stream, count: int) -> list:
    return [await asyncio.wait_for(stream.__anext__(), 5) for _ in range(count)]


@pytest.mark.parametrize("local", [True, False], ids=["unix", "tcp"])
async def test_requests_get_their_own_tokens_in_order(local):
    core, endpoint, connection, _ = await _connected(local)
    try:
        a = await connection.add("k1", "client-1", [5, 6], {"max_tokens": 4}, 0)
        b = await connection.add("k2", "client-2", [7], {"max_tokens": 4}, 1)
        assert [entry[:2] for entry in core.added] == [("k1", "client-1"), ("k2", "client-2")]
        core.publish(("k1", [10], [], None, None, 0), ("k2", [20], [], None, None, 0))
        core.publish(("k1", [11, 12], [], "length", None, None))
        core.publish(("k2", [21], [], "eos", None, None))
        first, second = await _batches(a, 1), await _batches(b, 1)
        assert first == [[[[10], [], None, None, 0], [[11, 12], [], "length", None, None]]]
        assert second == [[[[20], [], None, None, 0], [[21], [], "eos", None, None]]]
        with pytest.raises(StopAsyncIteration):
            await a.__anext__()
        assert connection.load == 0
    finally:
        connection.close()
        endpoint.close()


async def test_a_refusal_names_its_kind_and_a_cancel_aborts_on_the_engine():
    core, endpoint, connection, _ = await _connected()
    try:
        with pytest.raises(RefusedError) as refused:
            await connection.add("k1", "c", [1], {"refuse": True}, 0)
        assert refused.value.kind == "queue_full"
        stream = await connection.add("k2", "c", [1], {}, 0)
        stream.cancel()
        for _ in range(50):
            if core.aborted:
                break
            await asyncio.sleep(0.01)
        assert core.aborted == ["k2"]
    finally:
        connection.close()
        endpoint.close()


async def test_an_ingress_that_goes_away_aborts_its_requests():
    core, endpoint, connection, _ = await _connected()
    try:
        await connection.add("k1", "c", [1], {}, 0)
        await connection.add("k2", "c", [1], {}, 0)
        connection.writer.close()
        for _ in range(50):
            if len(core.aborted) == 2:
                break
            await asyncio.sleep(0.01)
        assert sorted(core.aborted) == ["k1", "k2"]
    finally:
        endpoint.close()


async def test_an_engine_that_goes_away_ends_every_stream_with_an_error():
    core, endpoint, connection, gone = await _connected()
    stream = await connection.add("k1", "c", [1], {}, 0)
    endpoint.close()  # as a replica that stops
    (batch,) = await _batches(stream, 1)
    assert batch[-1][2] == "error" and "went away" in batch[-1][3]
    assert gone == [connection]
    with pytest.raises(Exception, match="closed"):
        await connection.add("k2", "c", [1], {}, 0)


async def test_a_connection_without_the_token_is_dropped():
    core = StubCore()
    endpoint = EngineEndpoint(core, "127.0.0.1")
    address = await endpoint.start()
    reader, writer = await asyncio.open_unix_connection(address["unix"])
    writer.write(hello(b"x" * 32, "intruder"))
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed unanswered
    assert not core.outputs.sinks
    endpoint.close()


async def _until(predicate, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


async def test_an_ingress_that_stops_reading_is_cut_off_and_its_requests_aborted(monkeypatch):
    """An ingress that reads none of its outputs must not grow the engine without
    bound; once too much waits unsent, its channel is dropped at once (not left
    closing behind the unsent bytes): its requests are aborted, and it learns the
    channel is gone, so it never waits on a request the engine no longer reads."""
    from iterserve.cluster import engine_channel

    monkeypatch.setattr(engine_channel, "MAX_UNSENT_BYTES", 64 << 10)
    core = StubCore()
    endpoint = EngineEndpoint(core, "127.0.0.1")
    address = await endpoint.start()
    reader, writer = await asyncio.open_unix_connection(address["unix"])
    writer.write(hello(bytes.fromhex(address["token"]), "slow-ingress"))
    for key in ("k1", "k2"):
        writer.write(encode([engine_channel.ADD, key, "label", [1], {}, 0]))
    try:
        assert await _until(lambda: len(core.added) == 2)
        for _ in range(64):  # ~4 MiB of outputs the ingress never reads
            core.publish(("k1", list(range(8192)), [], None, None, None))
            await asyncio.sleep(0)
        assert await _until(lambda: sorted(core.aborted) == ["k1", "k2"])
        assert not core.outputs.sinks and not endpoint.writers
        # The ingress's end sees the channel end (after what was sent before the cut).
        while await asyncio.wait_for(reader.read(1 << 20), 10):
            pass
    finally:
        writer.close()
        endpoint.close()


async def test_one_steps_outputs_past_the_frame_bound_arrive_in_several_frames(monkeypatch):
    """A step's outputs for one ingress (long prompt logprobs, many streams) can be
    more than one frame may hold: they are split, and every stream gets its own."""
    from iterserve.cluster import engine_channel

    monkeypatch.setattr(engine_channel, "MAX_FRAME_BYTES", 16 << 10)
    core, endpoint, connection, _ = await _connected()
    try:
        streams = [await connection.add(f"k{i}", "c", [1], {}, 0) for i in range(8)]
        core.publish(*((f"k{i}", list(range(1000 * i, 1000 * i + 1000)), [], "length", None, None)
                       for i in range(8)))  # fmt: skip
        for i, stream in enumerate(streams):
            (batch,) = await _batches(stream, 1)
            assert batch == [[list(range(1000 * i, 1000 * i + 1000)), [], "length", None, None]]
        assert not connection.closed
    finally:
        connection.close()
        endpoint.close()


async def test_a_record_past_the_frame_bound_fails_its_request_alone(monkeypatch):
    from iterserve.cluster import engine_channel

    monkeypatch.setattr(engine_channel, "MAX_FRAME_BYTES", 16 << 10)
    core, endpoint, connection, _ = await _connected()
    try:
        big = await connection.add("big", "c", [1], {}, 0)
        small = await connection.add("small", "c", [1], {}, 0)
        core.publish(("big", list(range(10_000)), [], None, None, None),
                     ("small", [7], [], "eos", None, None))  # fmt: skip
        (failed,) = await _batches(big, 1)
        assert failed[-1][2] == "error" and "frame" in failed[-1][3]
        assert await _batches(small, 1) == [[[[7], [], "eos", None, None]]]
        assert not connection.closed
        assert await _until(lambda: "big" in core.aborted)  # the engine stops computing it
    finally:
        connection.close()
        endpoint.close()
