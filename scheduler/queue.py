"""The waiting queue, and the order of service (``scheduling_policy``).

``priority`` (the default: a request's priority, then its arrival; preemption
takes the worst) and ``fcfs`` (arrival alone) are one bounded heap under two
orders; ``fair`` keeps one heap per tenant (:mod:`.fair`). Besides holding the
waiting requests, the queue answers the batching policy's questions of order
(through the step builder): in which order running prompts continue, whom to
preempt, whether a waiting prompt goes before a running prompt's next piece;
and it is told what each step computed for whom (``charge_step``), which only
``fair`` counts.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from .errors import QueueFullError
from .request import Request, RequestStatus

if TYPE_CHECKING:
    from .config import SchedulerConfig
    from .messages import ScheduledSeq


_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def arrival_key(request: Request) -> tuple[float, str]:
    """``fcfs``: arrival alone (the request id breaks ties, as in every order)."""
    return (request.arrival_time, request.request_id)


class WaitingQueue:
    """A heap with lazy removal: ``remove`` (abort) is O(1); dead entries are
    skipped when they reach the top. ``key`` is the order of service, lowest first."""

    # Whether a waiting prompt may go before a running prompt's next piece (fair).
    interleaves = False

    def __init__(self, max_len: int, key: Callable[[Request], tuple] = Request.sort_key):
        self.max_len = max_len
        self.key = key
        self._heap: list[list] = []  # [key, tie, request, alive]
        self._entries: dict[str, list] = {}
        self._tie = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def check_room(self, request: Request) -> None:
        """Raises QueueFullError when ``request`` may not join (admission's bound)."""
        if len(self) >= self.max_len:  # (under fair, every tenant's queue together)
            raise QueueFullError(f"the waiting queue is full ({self.max_len} requests)")

    def push(self, request: Request) -> None:
        """Adds a request. Preempted requests come back through here too and are
        never refused: the bound applies to admission (:meth:`check_room`)."""
        entry = [self.key(request), next(self._tie), request, True]
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

    # -- the order among running requests ----------------------------------------------

    def order_key(self, request: Request) -> tuple:
        """The order in which running requests continue (lowest first)."""
        return self.key(request)

    def victim(self, running: Iterable[Request]) -> Request | None:
        """Whom a step short of KV blocks preempts: the last in service order."""
        return max(running, key=self.order_key, default=None)

    def yields_to(self, head: Request, request: Request) -> bool:
        """Whether waiting ``head`` goes before running ``request``'s next piece."""
        return False

    def charge_step(self, requests: dict[int, Request], entries: list[ScheduledSeq]) -> None:
        """What a step computed for whom (``requests``: slot -> request)."""

    def counters(self) -> dict[str, float]:
        """Each tenant's service as it counts it (``fair``: tokens / weight)."""
        return {}

    def check_integrity(self, requests: dict[str, Request]) -> None:
        """Every request it holds is one the scheduler knows as waiting, held once."""
        for request_id, entry in self._entries.items():
            request: Request = entry[2]
            assert requests.get(request_id) is request, f"{request_id} waits, unknown"
            assert request.status in _WAITING, f"{request_id} waits as {request.status.name}"
        live = sum(1 for entry in self._heap if entry[3])
        assert live == len(self._entries), "a removed entry is still live"


def make_queue(config: SchedulerConfig, running: dict[str, Request]) -> WaitingQueue:
    """The waiting queue of ``config.scheduling_policy``."""
    if config.scheduling_policy == "fair":
        from .fair import FairQueue

        return FairQueue(config, running)
    key = arrival_key if config.scheduling_policy == "fcfs" else Request.sort_key
    return WaitingQueue(config.max_queue_len, key)
