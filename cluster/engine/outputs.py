"""Where an engine's outputs go: to the client that reads each request's.

Every client is an engine channel connection with a *sink*: everything one step
produced for that client is handed over in one call, once the step's outputs
are all published (one frame per client per step, never one per token). Which
client a request belongs to is the request's own (``Request.client``): this
keeps no table of requests.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

from ...scheduler.messages import EngineOutput

Sink = Callable[[list[EngineOutput]], None]


class OutputBuffers:
    """Each client's sink, and its outputs not yet handed over."""

    def __init__(self) -> None:
        self.buffers: dict[str, list[EngineOutput]] = defaultdict(list)
        self.sinks: dict[str, Sink] = {}
        self._flush_pending = False

    def attach(self, client: str, sink: Sink) -> None:
        """From now on ``client``'s outputs go to ``sink``, a batch at a time."""
        self.sinks[client] = sink

    def detach(self, client: str) -> None:
        self.sinks.pop(client, None)
        self.buffers.pop(client, None)

    def push(self, client: str, output: EngineOutput) -> None:
        """Queues an output for ``client`` (dropped when it is gone)."""
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
