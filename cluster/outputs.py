"""Where an engine's outputs go: to the consumer that owns each request.

A consumer either has a *sink* (an ingress's engine channel): everything one
step produced for it is handed over in one call, once the step's outputs are
all published; or it polls (an ``AsyncEngine`` in another process): one
long-poll call per batch of steps, never one call per token.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

# One published record: (request_id, new_token_ids, new_logprobs, finish_reason, error,
# num_cached_tokens); the last is set on a request's first record with tokens: how
# many of its prompt tokens were found in the prefix cache.
Record = tuple[str, list[int], list, str | None, str | None, int | None]
Sink = Callable[[list[Record]], None]


class OutputBuffers:
    """Records per consumer, and which consumer owns each request."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}  # request_id -> consumer_id
        self.buffers: dict[str, list[Record]] = defaultdict(list)
        self.ready: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.sinks: dict[str, Sink] = {}
        self._flush_pending = False

    def own(self, request_id: str, consumer_id: str) -> None:
        self.owner[request_id] = consumer_id

    def attach(self, consumer_id: str, sink: Sink) -> None:
        """From now on ``consumer_id``'s records go to ``sink``, a batch at a time."""
        self.sinks[consumer_id] = sink

    def detach(self, consumer_id: str) -> list[str]:
        """Forgets a consumer; returns the requests it still owns (to abort)."""
        self.sinks.pop(consumer_id, None)
        self.buffers.pop(consumer_id, None)
        owned = [rid for rid, owner in self.owner.items() if owner == consumer_id]
        for request_id in owned:
            del self.owner[request_id]
        return owned

    def push(self, record: Record) -> None:
        """Queues a record for its request's consumer; a finishing record ends the
        request's ownership."""
        request_id = record[0]
        consumer = self.owner.get(request_id)
        if consumer is None:
            return
        if record[3] is not None:
            del self.owner[request_id]
        self.buffers[consumer].append(record)
        if consumer in self.sinks:
            if not self._flush_pending:
                # Everything pushed in this turn of the loop (one step's outputs, an
                # abort) leaves in one batch per consumer.
                self._flush_pending = True
                asyncio.get_running_loop().call_soon(self.flush)
        else:
            self.ready[consumer].set()

    def flush(self) -> None:
        self._flush_pending = False
        for consumer, sink in list(self.sinks.items()):
            records = self.buffers.pop(consumer, None)
            if records:
                sink(records)

    async def poll(self, consumer_id: str, timeout_s: float = 1.0) -> list[Record]:
        """Everything published for ``consumer_id`` since its last poll; waits up to
        ``timeout_s`` for something to arrive."""
        event = self.ready[consumer_id]
        if not self.buffers.get(consumer_id):
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                return []
        records = self.buffers.pop(consumer_id, [])
        event.clear()
        return records
