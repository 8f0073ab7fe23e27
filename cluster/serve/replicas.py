"""The ingress's view of its engine replicas: requests and tokens over the engine
channels, everything else (health, stats, model facts) through Serve.

Serve keeps the replicas running and says which exist; the ingress routes each
request itself: to the replica likely to hold its prompt's prefix in its cache
(:class:`PrefixRouter`), within a bound on imbalance, else to the one with the
fewest of its requests in flight. It opens one channel per replica (a Unix
socket when they share a node). A replica Serve replaces closes its channel:
the requests on it end with an error, and the next refresh finds the new one.

Only a replica that takes requests is ever chosen: one that announced it is
draining or dead (the channel's ``NOTICE``), or whose channel closed, is
skipped from that moment, and the prefix router forgets the prompts it had
recorded as that replica's. A request refused because its replica is gone,
dead or draining has reached nobody yet: it is tried on each other replica in
turn (after one refresh, when none is left) before the refusal reaches the client.
So is one that its replica accepted and then failed before its first token,
because the replica died or its channel closed (:class:`ReroutingStream`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

import ray

from ...scheduler.messages import EngineOutput
from ..engine.connection import EngineConnection, RequestStream
from ..engine.errors import EngineRefusal, EngineUnavailableError, refusal
from .routing import PrefixRouter, choose_replica

logger = logging.getLogger(__name__)
REFRESH_S = 5.0  # how often the ingress looks for replicas Serve started or replaced
# With no replica taking requests but some still loading (a redeploy, a scale-up
# from a stopping one), a request waits for them this long before it is refused.
LOADING_WAIT_S = 120.0
LOADING_POLL_S = 0.25
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
        self.loading: set[str] = set()  # replicas Serve runs whose engine still loads
        self._refreshing: asyncio.Task | None = None
        self._refresher: asyncio.Task | None = None

    # -- routing ------------------------------------------------------------------------

    async def open(self, request_id, prompt_token_ids, params, priority) -> RequestStream:
        """Queues a request on the replica chosen for it, or on another when that
        one turns out gone, dead or draining; raises the EngineRefusal that says
        why it was refused (``request_id`` is the client's: its label)."""
        if self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        tried: set[str] = set()
        stream = await self._open(request_id, prompt_token_ids, params, priority, tried)
        return ReroutingStream(
            self, stream, (request_id, prompt_token_ids, params, priority), tried
        )

    async def _open(self, request_id, prompt_token_ids, params, priority, tried) -> RequestStream:
        refused: EngineRefusal | None = None
        while True:
            connection = await self._pick(prompt_token_ids, tried, refused, params.get("lora_name"))
            tried.add(connection.replica)
            try:
                return await connection.open(request_id, prompt_token_ids, params, priority)
            except EngineUnavailableError as exc:  # closed, dead, draining: never started
                refused = exc
                self._unusable(connection)

    async def _pick(
        self,
        prompt_token_ids: list[int],
        tried: set[str],
        refused: EngineRefusal | None,
        adapter: str | None = None,
    ) -> EngineConnection:
        """The replica for a prompt among those that take requests and were not
        tried for it (preferring one where its LoRA ``adapter`` is resident); raises
        the last refusal (or ``unavailable``) when none is left."""
        live = self._usable(tried)
        if not live:
            await self._refresh()
            live = self._usable(tried)
            deadline = time.monotonic() + LOADING_WAIT_S
            while not live and self.loading and time.monotonic() < deadline:
                await asyncio.sleep(LOADING_POLL_S)  # a replica on its way: wait for it
                await self._refresh()
                live = self._usable(tried)
            if not live:
                raise refused or self._none_left()
        loads = {replica: c.load for replica, c in live.items()}
        return live[choose_replica(self.router, prompt_token_ids, loads, adapter)]

    def _usable(self, tried: set[str]) -> dict[str, EngineConnection]:
        return {r: c for r, c in self.connections.items() if c.usable and r not in tried}

    def _none_left(self) -> EngineRefusal:
        """Why no replica takes a request: the states they announced, if any."""
        states = [c for c in self.connections.values() if not c.closed]
        if not states:
            return EngineUnavailableError("no engine replica is ready")
        connection = states[0]
        return refusal(connection.state, connection.state_message or connection.state)

    def _unusable(self, connection: EngineConnection) -> None:
        """A replica no request may be sent to (any more): the router forgets it."""
        if self.router is not None:
            self.router.forget(connection.replica)

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
        self.loading = {e["replica"] for e in endpoints if isinstance(e, dict) and e.get("loading")}
        for endpoint in endpoints:
            if not isinstance(endpoint, dict) or endpoint.get("loading"):
                continue  # a replica still loading, failed or stopping
            if endpoint["replica"] in self.connections:
                continue
            local = endpoint["node_id"] == self.node_id
            try:
                self.connections[endpoint["replica"]] = await EngineConnection.connect(
                    endpoint,
                    f"{self.ingress_id}-{next(self.num_connections)}",
                    local,
                    self._forget,
                    self._unusable,
                )
            except OSError as exc:
                logger.warning("connecting to engine replica %s: %s", endpoint["replica"], exc)

    def _forget(self, connection: EngineConnection) -> None:
        if self.connections.get(connection.replica) is connection:
            del self.connections[connection.replica]
        self._unusable(connection)

    async def _refresh_forever(self) -> None:
        while True:
            # A replica on its way (a scale-out) takes requests the moment it is up.
            await asyncio.sleep(LOADING_POLL_S if self.loading else REFRESH_S)
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

    async def call_all(self, method: str, *args, timeout_s: float = 120.0) -> list:
        """``method(*args)`` on every engine replica (LoRA adapters' loads, the operator
        routes): each one's answer, or the exception it raised."""
        response = self.handle.broadcast(method, *args)
        return await response.results_async(timeout_s=timeout_s, return_exceptions=True)

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


class ReroutingStream:
    """A request's outputs, which move to another replica when the first one
    fails the request before its first token because that replica died or its
    channel closed: nothing has reached the client yet, so the client never
    hears of it. Any other failure, or one after a token, is the client's."""

    def __init__(self, client: ChannelEngineClient, stream: RequestStream, request, tried):
        self.client = client
        self.stream = stream
        self.request = request  # (label, prompt_token_ids, params, priority)
        self.tried = tried
        self.started = False  # an output with tokens (or a finish) came through

    def __aiter__(self) -> ReroutingStream:
        return self

    async def __anext__(self) -> list[EngineOutput]:
        while True:
            batch = await self.stream.__anext__()
            if self.started or not self._lost_before_starting(batch):
                self.started = True
                return batch
            try:
                self.stream = await self.client._open(*self.request, self.tried)
            except EngineRefusal:  # no other replica takes it: the failure stands
                self.started = True
                return batch

    def _lost_before_starting(self, batch: list[EngineOutput]) -> bool:
        last = batch[-1]
        if last.finish_reason != "error" or any(out.token_ids for out in batch):
            return False
        return not self.stream.connection.usable  # dead, or its channel closed

    def abort(self) -> None:
        self.stream.abort()

    def cancel(self) -> None:
        self.stream.cancel()
