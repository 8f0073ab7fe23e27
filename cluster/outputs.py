"""Where an engine's outputs wait for the consumers that own their requests.

Consumers (an ``EngineServer`` replica's fan-out, an ``AsyncEngine`` in another
process) fetch everything published for them with one long-poll call per batch
of steps, never one call per token.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

# One published record: (request_id, new_token_ids, new_logprobs, finish_reason, error)
Record = tuple[str, list[int], list, str | None, str | None]


class OutputBuffers:
    """Records per consumer, and which consumer owns each request."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}  # request_id -> consumer_id
        self.buffers: dict[str, list[Record]] = defaultdict(list)
        self.ready: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def own(self, request_id: str, consumer_id: str) -> None:
        self.owner[request_id] = consumer_id

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
        self.ready[consumer].set()

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
