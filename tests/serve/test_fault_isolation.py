"""The ingress never sends a request to a dead or draining replica, and one
refused because its replica is gone, dead or draining is tried on another before
the client hears of it: with three replicas, one dead, every request succeeds,
under load routing and prefix routing alike, and the prefix router forgets what
it had recorded as the dead replica's. (The real client, fake connections.)"""

from __future__ import annotations

import pytest

from iterserve.cluster.engine.channel import DEAD, DRAINING, SERVING
from iterserve.cluster.engine.errors import (
    EngineDeadError,
    EngineDrainingError,
    EngineUnavailableError,
)
from iterserve.cluster.serve.replicas import ChannelEngineClient
from iterserve.cluster.serve.routing import PrefixRouter


class FakeConnection:
    """An engine connection whose engine is serving, dead (it has not told this
    client yet: it refuses as dead), draining, or whose channel closed."""

    def __init__(self, replica: str, refuses: type[Exception] | None = None):
        self.replica = replica
        self.refuses = refuses
        self.closed = False
        self.state, self.state_message = SERVING, ""
        self.opened: list[str] = []
        self.streams: list[str] = []

    @property
    def load(self) -> int:
        return len(self.streams)

    @property
    def usable(self) -> bool:
        return not self.closed and self.state == SERVING

    async def open(self, label, prompt, params, priority):
        self.opened.append(label)
        if self.refuses is not None:
            if self.refuses is EngineDeadError:
                self.state, self.state_message = DEAD, "its ranks could not be restarted"
            raise self.refuses(f"replica {self.replica} refuses")
        self.streams.append(label)
        return label


class NoNewReplicas:
    """The engine deployment's handle: a refresh finds no replica it lacks."""

    def broadcast(self, method):
        return self

    async def results_async(self, timeout_s, return_exceptions):
        return []


def _client(routing: str, connections: list[FakeConnection]) -> ChannelEngineClient:
    router = PrefixRouter(block_size=4) if routing == "prefix" else None
    client = ChannelEngineClient(NoNewReplicas(), router)
    client._refresher = object()  # no background refresh in a unit test
    client.connections = {c.replica: c for c in connections}
    return client


@pytest.mark.parametrize("routing", ["load", "prefix"])
@pytest.mark.parametrize("fault", [EngineDeadError, EngineUnavailableError, EngineDrainingError])
async def test_a_refusing_replica_costs_no_request_and_is_never_chosen_again(routing, fault):
    live = [FakeConnection("a"), FakeConnection("b")]
    bad = FakeConnection("dead", refuses=fault)
    client = _client(routing, [bad, *live])
    prompt = list(range(40))  # the same prefix every time: the router's favourite
    for i in range(30):
        assert (await client.open(f"r{i}", prompt, {}, 0)).stream == f"r{i}"
    assert sum(len(c.streams) for c in live) == 30
    if fault is EngineDeadError:  # it said so: skipped from then on
        assert bad.opened == ["r0"]
    if client.router is not None:
        assert "dead" not in client.router.owners.values()


async def test_a_draining_or_dead_replica_is_skipped_without_being_tried():
    draining, dead, serving = FakeConnection("d"), FakeConnection("x"), FakeConnection("s")
    draining.state, dead.state = DRAINING, DEAD
    client = _client("prefix", [draining, dead, serving])
    for i in range(10):
        await client.open(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8], {}, 0)
    assert draining.opened == [] and dead.opened == [] and len(serving.streams) == 10


async def test_with_every_replica_draining_the_refusal_says_so():
    a, b = FakeConnection("a"), FakeConnection("b")
    a.state = b.state = DRAINING
    a.state_message = b.state_message = "the engine replica is stopping"
    client = _client("load", [a, b])
    with pytest.raises(EngineDrainingError, match="stopping"):
        await client.open("r", [1, 2, 3], {}, 0)


async def test_with_every_replica_dead_the_last_refusal_reaches_the_client():
    client = _client("load", [FakeConnection("a", EngineDeadError)])
    with pytest.raises(EngineDeadError):
        await client.open("r", [1, 2, 3], {}, 0)


def test_the_prefix_router_forgets_a_replica():
    router = PrefixRouter(block_size=4)
    loads = {"a": 0, "b": 5}
    assert router.pick(list(range(16)), loads) == "a"
    assert router.forget("a") == 4 and "a" not in router.owners.values()
    assert router.forget("a") == 0


class FakeStream:
    def __init__(self, connection, batches):
        self.connection, self.batches = connection, list(batches)
        self.cancelled = False

    async def __anext__(self):
        if not self.batches:
            raise StopAsyncIteration
        return self.batches.pop(0)

    def cancel(self):
        self.cancelled = True


class StreamingConnection(FakeConnection):
    """Accepts, then streams ``batches``; ``dies`` makes it dead after its first batch."""

    def __init__(self, replica, batches, dies=False):
        super().__init__(replica)
        self.batches, self.dies = batches, dies

    async def open(self, label, prompt, params, priority):
        self.opened.append(label)
        stream = FakeStream(self, self.batches)
        if self.dies:
            self.state = DEAD
        return stream


async def _outputs(stream) -> list:
    return [out async for batch in stream for out in batch]


async def test_a_request_its_replica_loses_before_the_first_token_moves_to_another():
    from iterserve.scheduler.messages import EngineOutput

    failed = [[EngineOutput.failed("k", "the engine's workers failed")]]
    tokens = [[EngineOutput("k", [5, 6], [], None, None, None, None)],
              [EngineOutput("k", [7], [], None, "length", None, None)]]  # fmt: skip
    dying = StreamingConnection("a", failed, dies=True)
    fine = StreamingConnection("b", tokens)
    client = _client("load", [dying, fine])
    fine.streams = ["busy"]  # load routing picks the dying one first
    outputs = await _outputs(await client.open("r", [1, 2], {}, 0))
    assert [t for out in outputs for t in out.token_ids] == [5, 6, 7]
    assert dying.opened == ["r"] and fine.opened == ["r"]

    # A failure after a token, or from a replica that still serves, stands.
    late = [tokens[0], failed[0]]
    client = _client("load", [StreamingConnection("a", late, dies=True), fine])
    outputs = await _outputs(await client.open("r2", [1, 2], {}, 0))
    assert outputs[-1].finish_reason == "error"
    client = _client("load", [StreamingConnection("a", failed)])
    outputs = await _outputs(await client.open("r3", [1, 2], {}, 0))
    assert outputs[-1].finish_reason == "error"
