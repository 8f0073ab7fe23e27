"""Per-tenant metrics with a bounded label set.

A tenant label's values come from requests (a gateway's fairness id, an OpenAI
``user``), so they are not left to grow: the ``NAMED_TENANTS`` tenants served
the most tokens lately are labelled by name, every other one as ``other``. The
choice is made again every ``RELABEL_S`` seconds; a tenant that drops out of it
has its series dropped (its later tokens count as ``other``), so the series of
each family stay at most ``NAMED_TENANTS + 1`` (plus the ones on their way out).

Per step the recorder only adds to a dict (``served``); the Prometheus series
are written once per step for the few labels a step touched, and the waiting
and running gauges once a second, from one scan of the scheduler's requests.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ...scheduler import Request
from .engine import EngineMetrics

if TYPE_CHECKING:
    from ...scheduler import Scheduler

NAMED_TENANTS = 8  # tenants labelled by name; the rest are "other"
OTHER = "other"
RELABEL_S = 30.0  # how often the busiest tenants are chosen again
REFRESH_S = 1.0  # how often the waiting and running gauges are written
TRACKED_TENANTS = 256  # tenants whose service is remembered (the least served go first)


class TenantMetrics:
    def __init__(self, metrics: EngineMetrics, clock=time.monotonic):
        self.metrics = metrics
        self.clock = clock
        self.named: set[str] = set()
        self.recent: dict[str, float] = {}  # tokens served since the last choice (decayed)
        self.totals: dict[str, int] = {}  # tokens served, all time (tracked tenants)
        self.missed: dict[str, int] = {}  # first tokens past their target (tracked tenants)
        self._pending: dict[str, int] = {}  # this step's tokens, by tenant
        self._relabel_at = 0.0
        self._refresh_at = 0.0

    def label(self, tenant: str) -> str:
        return tenant if tenant in self.named else OTHER

    def served(self, tenant: str, num_tokens: int) -> None:
        """Tokens a step computed for ``tenant`` (cheap: once per output)."""
        self._pending[tenant] = self._pending.get(tenant, 0) + num_tokens

    def first_token(self, request: Request, ttft_s: float, now: float) -> None:
        missed = request.ttft_deadline is not None and now > request.ttft_deadline
        if missed:
            self.missed[request.tenant] = self.missed.get(request.tenant, 0) + 1
        self.metrics.on_tenant_first_token(self.label(request.tenant), ttft_s, missed)

    def flush(self, sched: Scheduler) -> None:
        """Once per step: this step's tokens to the counters; the gauges and the
        choice of named tenants when their time has come."""
        now = self.clock()
        if now >= self._relabel_at:
            self._relabel()
            self._relabel_at = now + RELABEL_S
        by_label: dict[str, int] = {}
        for tenant, num_tokens in self._pending.items():
            self.recent[tenant] = self.recent.get(tenant, 0.0) + num_tokens
            self.totals[tenant] = self.totals.get(tenant, 0) + num_tokens
            label = self.label(tenant)
            by_label[label] = by_label.get(label, 0) + num_tokens
        self._pending.clear()
        for label, num_tokens in by_label.items():
            self.metrics.on_tenant_tokens(label, num_tokens)
        if len(self.totals) > TRACKED_TENANTS:
            self._forget()
        if now >= self._refresh_at:
            self._refresh_at = now + REFRESH_S
            waiting: dict[str, int] = {}
            running: dict[str, int] = {}
            for name, counts in sched.tenant_stats().items():
                label = self.label(name)
                waiting[label] = waiting.get(label, 0) + counts["waiting"]
                running[label] = running.get(label, 0) + counts["running"]
            self.metrics.set_tenants(waiting, running)

    def _relabel(self) -> None:
        busiest = sorted(self.recent, key=self.recent.__getitem__, reverse=True)
        named = set(busiest[:NAMED_TENANTS])
        for gone in self.named - named:
            self.metrics.drop_tenant(gone)
        self.named = named
        # Halved, not cleared: a tenant busy until a moment ago does not lose its name
        # to one that was served a few tokens since.
        self.recent = {t: served / 2 for t, served in self.recent.items() if served >= 1}

    def _forget(self) -> None:
        """Keeps the ``TRACKED_TENANTS`` most served tenants' figures (and the named)."""
        keep = sorted(self.totals, key=self.totals.__getitem__, reverse=True)[:TRACKED_TENANTS]
        kept = set(keep) | self.named
        for table in (self.totals, self.recent, self.missed):
            for tenant in [t for t in table if t not in kept]:
                del table[tenant]

    def stats(self) -> dict[str, dict]:
        """Tokens served (the last step's included) and first-token targets missed,
        per tracked tenant."""
        totals = dict(self.totals)
        for tenant, num_tokens in self._pending.items():
            totals[tenant] = totals.get(tenant, 0) + num_tokens
        return {
            tenant: {"served_tokens": served, "ttft_slo_missed": self.missed.get(tenant, 0)}
            for tenant, served in totals.items()
        }
