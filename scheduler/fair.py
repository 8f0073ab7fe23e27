"""Fairness between tenants (``scheduling_policy: fair``): the Virtual Token
Counter of Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024),
at the iteration where the decision is made.

Each tenant has a counter of the service it received: the tokens its requests
made the engine compute (prefill pieces, decodes and proposals; cached prompt
tokens cost nothing), divided by its weight. Whenever a step takes a waiting
request, it takes the least-served waiting tenant's next one::

    counters   a: 5200   b: 310 (lifted on arrival)   c: 330
    waiting    a: [a7 a8 a9 ...]   b: [b1]   c: [c4 c5]
    order      b1, c4, c5, then a7 ... (as the counters move with each step)

- A tenant that had nothing waiting is *lifted* when a request of its arrives:
  its counter becomes at least the least counter among the tenants that wait
  (none waiting: the counter of the last one to stop waiting), so that idling
  earns no credit to spend in a burst. Counters never go down. Between equal
  counters (a tenant just lifted ties the least one), the tenant with fewer
  requests waiting goes first, then the one served longest ago.
- Inside a tenant, priority then arrival orders its requests, as ``priority`` does.
- A running prompt's next piece yields to a waiting prompt of a less-served
  tenant: the newcomer starts in the step being built, and the piece shrinks
  to no more than the newcomers took, so that their step stays short (the
  batching policy asks :meth:`FairQueue.yields_to`).
- Preemption takes its victim from the most-served tenant among those running:
  its worst request by priority, then arrival.
- A tenant may have ``max_queue_len_per_tenant`` requests waiting: a flood is
  refused (429) before the queue as a whole fills.
- First-token targets (a request's ``ttft_deadline``) order admission by
  deadline among the tenants whose counters are within one step's token budget
  of the least one; a request past its deadline is served as any other.

A step is charged when it is built (:meth:`FairQueue.charge_step`): choices
within one step see the counters as the step began. The counters of tenants
with nothing waiting or running are forgotten once they fall to the least
waiting tenant's (a lift would bring them there anyway), and past
``MAX_IDLE_TENANTS`` the lowest first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import QueueFullError
from .queue import WaitingQueue
from .request import Request

if TYPE_CHECKING:
    from .config import SchedulerConfig
    from .messages import ScheduledSeq

MAX_IDLE_TENANTS = 4096  # counters kept for tenants with nothing waiting or running


@dataclass(slots=True)
class Tenant:
    name: str
    weight: float
    queue: WaitingQueue  # its waiting requests, priority then arrival
    counter: float = 0.0  # tokens computed for it / weight
    served_at: int = -1  # the step that last charged it

    @property
    def rank(self) -> tuple[float, int, int, str]:
        """Least-served first; between equals (a tenant just lifted to the others'
        counter), the one with fewer requests waiting, then the one served longest ago."""
        return (self.counter, len(self.queue), self.served_at, self.name)


def _rank(tenant: Tenant) -> tuple[float, int, int, str]:
    return tenant.rank


class FairQueue(WaitingQueue):
    """The waiting side of ``fair``: one queue per tenant and their counters.
    ``running`` is the scheduler's table of running requests (read only)."""

    interleaves = True

    def __init__(self, config: SchedulerConfig, running: dict[str, Request]):
        super().__init__(config.max_queue_len)
        self.per_tenant = config.tenant_queue_len
        self.budget = config.token_budget
        self.settings = config.tenants
        self.running = running
        self.tenants: dict[str, Tenant] = {}  # every tenant with a counter
        self.waiting: dict[str, Tenant] = {}  # those with requests waiting
        self._where: dict[str, Tenant] = {}  # request_id -> its tenant
        self.last_left = 0.0  # the counter of the last tenant to stop waiting
        self.clock = 0  # steps charged

    # -- the waiting requests -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._where

    def check_room(self, request: Request) -> None:
        super().check_room(request)
        tenant = self.waiting.get(request.tenant)
        if tenant is not None and len(tenant.queue) >= self.per_tenant:
            raise QueueFullError(
                f"tenant {request.tenant!r} has {len(tenant.queue)} requests waiting, its "
                f"most (max_queue_len_per_tenant)"
            )

    def push(self, request: Request) -> None:
        tenant = self.tenants.get(request.tenant)
        if tenant is None:
            weight = float(self.settings.get(request.tenant, {}).get("weight", 1.0))
            tenant = self.tenants[request.tenant] = Tenant(
                request.tenant, weight, WaitingQueue(self.max_len)
            )
        if request.tenant not in self.waiting:  # (re)activated: no credit for idling
            floor = min((t.counter for t in self.waiting.values()), default=self.last_left)
            tenant.counter = max(tenant.counter, floor)
            self.waiting[tenant.name] = tenant
        tenant.queue.push(request)
        self._where[request.request_id] = tenant

    def remove(self, request_id: str) -> None:
        tenant = self._where.pop(request_id)
        tenant.queue.remove(request_id)
        if not len(tenant.queue):
            del self.waiting[tenant.name]
            self.last_left = tenant.counter
            if len(self.tenants) > len(self.waiting) + MAX_IDLE_TENANTS:
                self._forget_idle()

    def peek(self) -> Request | None:
        tenant = self._next_tenant()
        return None if tenant is None else tenant.queue.peek()

    def _next_tenant(self) -> Tenant | None:
        """The least-served waiting tenant; or, among those within one step's budget
        of it, the one whose next request is due first."""
        if not self.waiting:
            return None
        least = min(self.waiting.values(), key=_rank)
        due, due_at = least, self._deadline(least)
        reach = least.counter + self.budget
        for tenant in self.waiting.values():
            if tenant.counter <= reach:
                at = self._deadline(tenant)
                if at < due_at or at == due_at and tenant.rank < due.rank:
                    due, due_at = tenant, at
        return due

    @staticmethod
    def _deadline(tenant: Tenant) -> float:
        head = tenant.queue.peek()
        deadline = None if head is None else head.ttft_deadline
        return float("inf") if deadline is None else deadline

    def _tenants_in_order(self) -> list[Tenant]:
        return sorted(self.waiting.values(), key=_rank)

    def in_order(self) -> Iterator[Request]:
        """Tenant by tenant, least served first (an approximation of the order the
        steps would take them in: the counters move as they are served)."""
        for tenant in self._tenants_in_order():
            yield from tenant.queue.in_order()

    def first(self, accept: Callable[[Request], bool]) -> Request | None:
        return next((request for request in self.in_order() if accept(request)), None)

    def oldest_arrival(self) -> float | None:
        arrivals = (t.queue.oldest_arrival() for t in self.waiting.values())
        return min((at for at in arrivals if at is not None), default=None)

    # -- the order among running requests ------------------------------------------------

    def order_key(self, request: Request) -> tuple:
        return (self.tenants[request.tenant].counter, *request.sort_key())

    def victim(self, running: Iterable[Request]) -> Request | None:
        """The most-served running tenant's worst request."""
        return max(running, key=self.order_key, default=None)

    def yields_to(self, head: Request, request: Request) -> bool:
        if head.tenant == request.tenant:
            return False  # inside a tenant, priority then arrival
        return self.tenants[head.tenant].rank < self.tenants[request.tenant].rank

    def charge_step(self, requests: dict[int, Request], entries: list[ScheduledSeq]) -> None:
        """Charges each tenant the tokens a step computes for it, as it is built
        (``requests``: slot -> request; padding is nobody's)."""
        served: dict[str, int] = {}
        for entry in entries:
            name = requests[entry.slot_idx].tenant
            served[name] = served.get(name, 0) + entry.num_tokens
        self.clock += 1
        tenants = self.tenants
        for name, num_tokens in served.items():
            tenant = tenants[name]
            tenant.counter += num_tokens / tenant.weight
            tenant.served_at = self.clock

    def _forget_idle(self) -> None:
        """Drops the counters of tenants with nothing waiting or running: first those
        a lift would raise anyway, then the lowest, down to ``MAX_IDLE_TENANTS``."""
        busy = {r.tenant for r in self.running.values()} | set(self.waiting)
        floor = min((t.counter for t in self.waiting.values()), default=self.last_left)
        idle = sorted(
            (t for t in self.tenants.values() if t.name not in busy), key=lambda t: t.counter
        )
        excess = len(idle) - MAX_IDLE_TENANTS
        for i, tenant in enumerate(idle):
            if tenant.counter > floor and i >= excess:
                break
            del self.tenants[tenant.name]

    # -- what the scheduler reads ---------------------------------------------------------

    def counters(self) -> dict[str, float]:
        return {name: tenant.counter for name, tenant in self.tenants.items()}

    def check_integrity(self, requests: dict[str, Request]) -> None:
        held = 0
        for name, tenant in self.tenants.items():
            assert tenant.name == name and tenant.counter >= 0 and tenant.weight > 0
            tenant.queue.check_integrity(requests)
            for request in tenant.queue.in_order():
                assert request.tenant == name, f"{request.request_id} waits as {name}'s"
                assert self._where.get(request.request_id) is tenant, "waiting index"
            assert (name in self.waiting) == bool(len(tenant.queue)), f"{name}: backlog"
            held += len(tenant.queue)
        assert held == len(self._where), "a waiting request is in no tenant's queue"
        assert self.waiting.keys() <= self.tenants.keys()
        for request in self.running.values():
            assert request.tenant in self.tenants, f"{request.tenant}: running uncounted"
