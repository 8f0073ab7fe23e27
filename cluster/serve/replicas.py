"""The ingress's view of its engine replicas: requests and tokens over the engine
channels, everything else (health, stats, model facts) through Serve.

Serve keeps the replicas running and says which exist; the ingress routes each
request itself: to the replica likely to hold its prompt's prefix in its cache
(:class:`PrefixRouter`), within a bound on imbalance, else to the one with the
fewest of its requests in flight. It opens one channel per replica (a Unix socket when they share a node). A replica
Serve replaces closes its channel: the requests on it end with an error, and
the next refresh finds the new one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid

import ray

from ..engine.connection import EngineConnection, RequestStream
from ..engine.errors import EngineUnavailableError
from .routing import PrefixRouter, choose_replica

logger = logging.getLogger(__name__)
REFRESH_S = 5.0  # how often the ingress looks for replicas Serve started or replaced
ENDPOINT_TIMEOUT_S = 10.0


class ChannelEngineClient:
    """What the HTTP layer needs from the engine replicas (see ``EngineClient``)."""

    def __init__(self, handle, router: PrefixRouter | None = None):
        self.handle = handle  # the EngineServer deployment: control-plane calls
        self.router = router  # None: by load alone
        self.ingress_id = uuid.uuid4().hex[:12]
        self.num_connections = itertools.count()  # each connection's own name: its keys' prefix
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        self.connections: dict[str, EngineConnection] = {}
        self._refreshing: asyncio.Task | None = None
        self._refresher: asyncio.Task | None = None

    # -- routing ------------------------------------------------------------------------

    async def open(self, request_id, prompt_token_ids, params, priority) -> RequestStream:
        """Queues a request on the replica chosen for it; raises the EngineRefusal
        that says why it was refused (``request_id`` is the client's: its label)."""
        if self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        for attempt in range(2):  # once more after a refresh, if the first replica was gone
            connection = await self._pick(prompt_token_ids, params.get("lora_name"))
            try:
                return await connection.open(request_id, prompt_token_ids, params, priority)
            except EngineUnavailableError as exc:
                if type(exc) is not EngineUnavailableError or attempt == 1:
                    raise
            await self._refresh()
        raise AssertionError("unreachable")

    async def _pick(self, prompt_token_ids: list[int], adapter: str | None) -> EngineConnection:
        live = {r: c for r, c in self.connections.items() if not c.closed}
        if not live:
            await self._refresh()
            live = {r: c for r, c in self.connections.items() if not c.closed}
            if not live:
                raise EngineUnavailableError("no engine replica is ready")
        loads = {replica: c.load for replica, c in live.items()}
        return live[choose_replica(self.router, prompt_token_ids, loads, adapter)]

    # -- replicas -------------------------------------------------------------------------

    async def _refresh(self) -> None:
        """Connects to every ready replica not connected yet (one refresh at a time)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._connect_new())
        await asyncio.shield(self._refreshing)

    async def _connect_new(self) -> None:
        response = self.handle.broadcast("endpoint")
        try:
            endpoints = await response.results_async(
                timeout_s=ENDPOINT_TIMEOUT_S, return_exceptions=True
            )
        except Exception as exc:  # no replica at all yet
            logger.warning("looking for engine replicas failed: %s", exc)
            return
        for endpoint in endpoints:
            if not isinstance(endpoint, dict) or endpoint["replica"] in self.connections:
                continue  # a replica still loading, failed, or connected already
            local = endpoint["node_id"] == self.node_id
            try:
                self.connections[endpoint["replica"]] = await EngineConnection.connect(
                    endpoint, f"{self.ingress_id}-{next(self.num_connections)}", local, self._forget
                )
            except OSError as exc:
                logger.warning("connecting to engine replica %s: %s", endpoint["replica"], exc)

    def _forget(self, connection: EngineConnection) -> None:
        if self.connections.get(connection.replica) is connection:
            del self.connections[connection.replica]

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self._refresh()
            except Exception:  # a refresh failing now must not end the next ones
                logger.exception("refreshing the engine replicas failed")

    # -- the control plane, through Serve ---------------------------------------------------

    async def info(self) -> dict:
        return await self.handle.info.remote()

    async def _broadcast(self, method: str, timeout_s: float) -> list:
        response = self.handle.broadcast(method)
        return await response.results_async(timeout_s=timeout_s, return_exceptions=True)

    async def stats(self) -> list[dict]:
        return [r for r in await self._broadcast("stats", 30) if isinstance(r, dict)]

    async def call_all(self, method: str, *args) -> list:
        """``method(*args)`` on every engine replica (LoRA adapters' loads): each
        one's answer, or the exception it raised."""
        response = self.handle.broadcast(method, *args)
        return await response.results_async(timeout_s=120, return_exceptions=True)

    async def health(self) -> list[dict]:
        return [
            r
            if isinstance(r, dict)
            else {"healthy": False, "ready": False, "message": f"{type(r).__name__}: {r}"}
            # A health ping waits for the step in flight; probes want an answer soon.
            for r in await self._broadcast("health", 10)
        ]

    def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for connection in list(self.connections.values()):
            connection.close()
