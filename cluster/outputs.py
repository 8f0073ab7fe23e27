"""Where an engine's outputs go: to the client that owns each request.

Every client is an engine channel connection with a *sink*: everything one step
produced for that client is handed over in one call, once the step's outputs
are all published (one frame per client per step, never one per token).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

from iterserve.scheduler.messages import EngineOutput

Sink = Callable[[list[EngineOutput]], None]


class OutputBuffers:
    """Outputs per client, and which client owns each request."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}  # request_id -> client
        self.buffers: dict[str, list[EngineOutput]] = defaultdict(list)
        self.sinks: dict[str, Sink] = {}
        self._flush_pending = False

    def own(self, request_id: str, client: str) -> None:
        self.owner[request_id] = client

    def attach(self, client: str, sink: Sink) -> None:
        """From now on ``client``'s outputs go to ``sink``, a batch at a time."""
        self.sinks[client] = sink

    def detach(self, client: str) -> list[str]:
        """Forgets a client; returns the requests it still owns (to abort)."""
        self.sinks.pop(client, None)
        self.buffers.pop(client, None)
        owned = [rid for rid, owner in self.owner.items() if owner == client]
        for request_id in owned:
            del self.owner[request_id]
        return owned

    def push(self, output: EngineOutput) -> None:
        """Queues an output for its request's client; a finishing output ends the
        request's ownership."""
        client = self.owner.get(output.request_id)
        if client is None:
            return
        if output.finish_reason is not None:
            del self.owner[output.request_id]
        if client not in self.sinks:
            return
        self.buffers[client].append(output)
        if not self._flush_pending:
            # Everything pushed in this turn of the loop (one step's outputs, an
            # abort) leaves in one batch per client.
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_pending = False
        for client, sink in list(self.sinks.items()):
            batch = self.buffers.pop(client, None)
            if batch:
                sink(batch)
