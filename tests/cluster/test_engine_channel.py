"""The engine channel on its own (no Ray): requests in, each step's outputs out in
one frame, aborts, refusals, the token, and either end going away."""

from __future__ import annotations

import asyncio

import pytest

from iterserve.cluster.engine import channel as engine_channel
from iterserve.cluster.engine.channel import ADD, EngineEndpoint, encode
from iterserve.cluster.engine.connection import EngineConnection
from iterserve.cluster.engine.errors import EngineBusyError, EngineUnavailableError
from iterserve.cluster.engine.outputs import OutputBuffers
from iterserve.cluster.framing import hello
from iterserve.scheduler.messages import EngineOutput, EngineRequest, PromptLogprobs
from iterserve.scheduler.sampling import SamplingParams


class StubCore:
    """What the endpoint needs of an EngineCore."""

    state = ("serving", "")

    def __init__(self):
        self.outputs = OutputBuffers()
        self.added: list[tuple] = []
        self.aborted: list[str] = []
        self.clients: dict[str, str] = {}  # running request -> its client

    async def add_request(self, client, request):
        if request.tenant == "refuse-me":
            return ("queue_full", "the waiting queue is full")
        self.clients[request.request_id] = client
        self.added.append((request.request_id, request.label, request.prompt_token_ids,
                           request.priority))  # fmt: skip
        return None

    async def abort(self, key):
        self.aborted.append(key)
        self.publish(EngineOutput.aborted(key))

    def requests_of(self, client):
        return [key for key, owner in self.clients.items() if owner == client]

    def publish(self, *outputs: EngineOutput):
        for output in outputs:
            client = self.clients.get(output.request_id)
            if output.finished:
                self.clients.pop(output.request_id, None)
            if client is not None:
                self.outputs.push(client, output)


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


async def _until(predicate, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("local", [True, False], ids=["unix", "tcp"])
async def test_requests_get_their_own_outputs_in_order(local):
    core, endpoint, connection, _ = await _connected(local)
    try:
        a = await connection.open("client-1", [5, 6], {"max_tokens": 4}, 0)
        b = await connection.open("client-2", [7], {"max_tokens": 4}, 1)
        assert [entry[1:] for entry in core.added] == [
            ("client-1", [5, 6], 0),
            ("client-2", [7], 1),
        ]
        assert a.key != b.key and {a.key, b.key} == {key for key, *_ in core.added}
        prompt = PromptLogprobs(3, [-0.5], [1], [[(6, -0.5)]])
        first = [
            EngineOutput(a.key, [10], [(-0.1, [(10, -0.1)])], prompt, num_cached_tokens=0),
            EngineOutput(a.key, [11, 12], finish_reason="length"),
        ]
        core.publish(first[0], EngineOutput(b.key, [20], num_cached_tokens=0))
        core.publish(first[1])
        core.publish(EngineOutput(b.key, [21], finish_reason="eos"))
        assert await _batches(a, 1) == [first]
        assert await _batches(b, 1) == [
            [EngineOutput(b.key, [20], num_cached_tokens=0), EngineOutput(b.key, [21], finish_reason="eos")]
        ]  # fmt: skip
        with pytest.raises(StopAsyncIteration):
            await a.__anext__()
        assert connection.load == 0
    finally:
        connection.close()
        endpoint.close()


async def test_a_refusal_raises_its_class_and_a_cancel_aborts_on_the_engine():
    core, endpoint, connection, _ = await _connected()
    try:
        with pytest.raises(EngineBusyError) as refused:
            await connection.open("c", [1], {"tenant": "refuse-me"}, 0)
        assert refused.value.kind == "queue_full" and "full" in refused.value.message
        stream = await connection.open("c", [1], {}, 0)
        stream.cancel()
        assert await _until(lambda: core.aborted == [stream.key])
    finally:
        connection.close()
        endpoint.close()


async def test_a_client_that_goes_away_aborts_its_requests():
    core, endpoint, connection, _ = await _connected()
    try:
        keys = [(await connection.open("c", [1], {}, 0)).key for _ in range(2)]
        connection.writer.close()
        assert await _until(lambda: sorted(core.aborted) == sorted(keys))
    finally:
        endpoint.close()


async def test_an_engine_that_goes_away_ends_every_stream_with_an_error():
    core, endpoint, connection, gone = await _connected()
    stream = await connection.open("c", [1], {}, 0)
    endpoint.close()  # as a replica that stops
    ((output,),) = await _batches(stream, 1)
    assert output.finish_reason == "error" and "went away" in output.error
    assert gone == [connection]
    with pytest.raises(EngineUnavailableError, match="closed"):
        await connection.open("c", [1], {}, 0)


async def test_a_connection_without_the_token_is_dropped():
    core = StubCore()
    endpoint = EngineEndpoint(core, "127.0.0.1")
    address = await endpoint.start()
    reader, writer = await asyncio.open_unix_connection(address["unix"])
    writer.write(hello(b"x" * 32, "intruder"))
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed unanswered
    assert not core.outputs.sinks
    endpoint.close()


async def test_a_client_that_stops_reading_is_cut_off_and_its_requests_aborted(monkeypatch):
    """A client that reads none of its outputs must not grow the engine without
    bound; once too much waits unsent, its channel is dropped at once (not left
    closing behind the unsent bytes): its requests are aborted, and it learns the
    channel is gone, so it never waits on a request the engine no longer reads."""
    monkeypatch.setattr(engine_channel, "MAX_UNSENT_BYTES", 64 << 10)
    core = StubCore()
    endpoint = EngineEndpoint(core, "127.0.0.1")
    address = await endpoint.start()
    reader, writer = await asyncio.open_unix_connection(address["unix"])
    writer.write(hello(bytes.fromhex(address["token"]), "slow-client"))
    for key in ("k1", "k2"):
        writer.write(encode(ADD, EngineRequest(key, "label", [1], SamplingParams())))
    try:
        assert await _until(lambda: len(core.added) == 2)
        for _ in range(64):  # ~4 MiB of outputs the client never reads
            core.publish(EngineOutput("k1", list(range(8192))))
            await asyncio.sleep(0)
        assert await _until(lambda: sorted(core.aborted) == ["k1", "k2"])
        assert not core.outputs.sinks and not endpoint.writers
        # The client's end sees the channel end (after what was sent before the cut).
        while await asyncio.wait_for(reader.read(1 << 20), 10):
            pass
    finally:
        writer.close()
        endpoint.close()


async def test_one_steps_outputs_past_the_frame_bound_arrive_in_several_frames(monkeypatch):
    """A step's outputs for one client (long prompt logprobs, many streams) can be
    more than one frame may hold: they are split, and every stream gets its own."""
    monkeypatch.setattr(engine_channel, "MAX_FRAME_BYTES", 16 << 10)
    core, endpoint, connection, _ = await _connected()
    try:
        streams = [await connection.open("c", [1], {}, 0) for _ in range(8)]
        sent = [
            EngineOutput(s.key, list(range(1000 * i, 1000 * i + 1000)), finish_reason="length")
            for i, s in enumerate(streams)
        ]
        core.publish(*sent)
        for stream, output in zip(streams, sent):
            assert await _batches(stream, 1) == [[output]]
        assert not connection.closed
    finally:
        connection.close()
        endpoint.close()


async def test_an_output_past_the_frame_bound_fails_its_request_alone(monkeypatch):
    monkeypatch.setattr(engine_channel, "MAX_FRAME_BYTES", 16 << 10)
    core, endpoint, connection, _ = await _connected()
    try:
        big = await connection.open("c", [1], {}, 0)
        small = await connection.open("c", [1], {}, 0)
        core.publish(EngineOutput(big.key, list(range(10_000))),
                     EngineOutput(small.key, [7], finish_reason="eos"))  # fmt: skip
        ((failed,),) = await _batches(big, 1)
        assert failed.finish_reason == "error" and "frame" in failed.error
        assert await _batches(small, 1) == [[EngineOutput(small.key, [7], finish_reason="eos")]]
        assert not connection.closed
        assert await _until(lambda: big.key in core.aborted)  # the engine stops computing it
    finally:
        connection.close()
        endpoint.close()


async def test_an_abort_asked_of_a_stream_ends_it_with_the_engines_abort_output():
    """AsyncEngine.abort: the request ends on the engine, and its stream still
    delivers the last output, whose finish reason says so."""
    core, endpoint, connection, _ = await _connected()
    try:
        stream = await connection.open("c", [1], {}, 0)
        core.publish(EngineOutput(stream.key, [4]))
        stream.abort()
        got = [out for batch in await _batches(stream, 1) for out in batch]
        while not got[-1].finished:
            got += await stream.__anext__()
        assert [o.token_ids for o in got] == [[4], []] and got[-1].finish_reason == "abort"
        assert core.aborted == [stream.key]
    finally:
        connection.close()
        endpoint.close()
