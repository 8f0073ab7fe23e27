"""The bounded waiting queue, served in (priority, arrival) order."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from .request import Request


class WaitingQueue:
    """A heap with lazy removal: ``remove`` (abort) is O(1); dead entries are
    skipped when they reach the top."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self._heap: list[list] = []  # [sort_key, tie, request, alive]
        self._entries: dict[str, list] = {}
        self._tie = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    @property
    def full(self) -> bool:
        return len(self._entries) >= self.max_len

    def push(self, request: Request) -> None:
        """Adds a request. Preempted requests come back through here too and are
        never refused: the bound applies to admission (see Scheduler.add_request)."""
        entry = [request.sort_key(), next(self._tie), request, True]
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def _drop_dead(self) -> None:
        while self._heap and not self._heap[0][3]:
            heapq.heappop(self._heap)

    def peek(self) -> Request | None:
        self._drop_dead()
        return self._heap[0][2] if self._heap else None

    def in_order(self) -> Iterator[Request]:
        """Every waiting request in service order (a full sort: for a static batch's
        launch, or when the head cannot go)."""
        for entry in sorted(self._entries.values(), key=lambda e: (e[0], e[1])):
            yield entry[2]

    def first(self, accept: Callable[[Request], bool]) -> Request | None:
        """The first request in service order that ``accept`` takes (e.g. one whose
        adapter has a slot, when the head's has none)."""
        return next((request for request in self.in_order() if accept(request)), None)

    def remove(self, request_id: str) -> None:
        entry = self._entries.pop(request_id)
        entry[3] = False

    def oldest_arrival(self) -> float | None:
        """Arrival time of the longest-waiting request (for batch timeouts)."""
        if not self._entries:
            return None
        return min(entry[2].arrival_time for entry in self._entries.values())
