"""Stored responses: what ``GET /v1/responses/{id}`` answers and ``previous_response_id``
continues, bounded, and reachable from every ingress replica.

A record is one response's JSON (the body, and the items of its conversation
before its output), so a continuation needs one read whichever replica made
it. The store keeps at most ``MAX_STORED_RESPONSES`` records and
``MAX_STORED_BYTES`` of them; past either bound the least recently used leave
first (a continuation of a response that left is refused with 404, naming it).
Under Ray Serve it is one small actor per served model (:func:`shared_store`);
without Ray (an in-process app) a plain object (:class:`LocalStore`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

MAX_STORED_RESPONSES = 10_000
MAX_STORED_BYTES = 256 << 20
STORE_NAMESPACE = "iterserve"


class ResponseStore:
    """Records by response id, least recently used first out."""

    def __init__(
        self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES
    ):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, bytes] = OrderedDict()
        self._num_bytes = 0

    def put(self, response_id: str, record: bytes) -> None:
        self.delete(response_id)
        self._records[response_id] = record
        self._num_bytes += len(record)
        while len(self._records) > self.max_responses or self._num_bytes > self.max_bytes:
            _, dropped = self._records.popitem(last=False)
            self._num_bytes -= len(dropped)

    def get(self, response_id: str) -> bytes | None:
        record = self._records.get(response_id)
        if record is not None:
            self._records.move_to_end(response_id)
        return record

    def delete(self, response_id: str) -> bool:
        record = self._records.pop(response_id, None)
        if record is not None:
            self._num_bytes -= len(record)
        return record is not None

    def stats(self) -> dict[str, int]:
        return {"num_responses": len(self._records), "num_bytes": self._num_bytes}


class AsyncStore(Protocol):
    async def put(self, response_id: str, record: bytes) -> None: ...

    async def get(self, response_id: str) -> bytes | None: ...

    async def delete(self, response_id: str) -> bool: ...


class LocalStore:
    """The store in this process (an app without Ray, tests)."""

    def __init__(self, store: ResponseStore | None = None):
        self.store = store or ResponseStore()

    async def put(self, response_id: str, record: bytes) -> None:
        self.store.put(response_id, record)

    async def get(self, response_id: str) -> bytes | None:
        return self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)


class ActorStore:
    """The store in a named Ray actor, shared by every ingress replica."""

    def __init__(self, actor):
        self.actor = actor

    async def put(self, response_id: str, record: bytes) -> None:
        await self.actor.put.remote(response_id, record)

    async def get(self, response_id: str) -> bytes | None:
        return await self.actor.get.remote(response_id)

    async def delete(self, response_id: str) -> bool:
        return await self.actor.delete.remote(response_id)


def store_name(model_name: str) -> str:
    """One store per served model, whatever app or replica serves it."""
    return f"iterserve-responses-{model_name}"


def shared_store(name: str) -> ActorStore:
    """The actor called ``name``, created by the first replica to ask. Detached, so
    it outlives the replica that made it (stored responses survive a redeploy);
    ``get_if_exists`` makes concurrent replicas agree on one."""
    import ray

    actor = (
        ray.remote(num_cpus=0)(ResponseStore)
        .options(
            name=name,
            namespace=STORE_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            # Not in a replica's placement group: it must not take a bundle, nor die with it.
            scheduling_strategy="DEFAULT",
        )
        .remote()
    )
    return ActorStore(actor)
