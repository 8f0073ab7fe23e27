"""Per-tenant metrics: the busiest tenants by name, the rest as ``other``, and a label
set that stays bounded however many tenants come."""

from __future__ import annotations

from iterserve.cluster.metrics.engine import EngineMetrics
from iterserve.cluster.metrics.tenants import (
    NAMED_TENANTS,
    OTHER,
    REFRESH_S,
    RELABEL_S,
    TenantMetrics,
)
from iterserve.scheduler import Request, SamplingParams


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StubScheduler:
    def __init__(self, tenants: dict[str, dict] | None = None):
        self.tenants = tenants or {}

    def tenant_stats(self) -> dict[str, dict]:
        return self.tenants


def by_tenant(metrics: EngineMetrics, family: str) -> dict[str, float]:
    return {
        s[1]["tenant"]: s[2]
        for name, _, _, samples in metrics.snapshot()
        if name == family
        for s in samples
    }


def labels(metrics: EngineMetrics, family: str) -> set[str]:
    return set(by_tenant(metrics, family))


def served(metrics: EngineMetrics) -> dict[str, float]:
    return by_tenant(metrics, "iterserve_tenant_served_tokens")


def test_only_the_busiest_tenants_have_their_own_series():
    metrics, clock = EngineMetrics("m", 0, "chunked"), Clock()
    tenants = TenantMetrics(metrics, clock)
    sched = StubScheduler()
    tenants.flush(sched)  # the first choice: nobody served yet, everyone is other
    for i in range(50):  # tenant i is served i + 1 tokens
        tenants.served(f"t{i}", i + 1)
    tenants.flush(sched)
    assert served(metrics) == {OTHER: sum(range(1, 51))}
    clock.now += RELABEL_S
    tenants.flush(sched)  # the choice is made again: the eight busiest by name
    for i in range(50):
        tenants.served(f"t{i}", 1)
    tenants.flush(sched)
    named = {f"t{i}" for i in range(50 - NAMED_TENANTS, 50)}
    assert set(served(metrics)) == named | {OTHER}
    assert served(metrics)[OTHER] == sum(range(1, 51)) + 50 - NAMED_TENANTS
    assert tenants.stats()["t49"]["served_tokens"] == 51


def just_named(tenant: str, queued: dict[str, int]):
    """Metrics, clock, recorder and scheduler once ``tenant``, the only one served
    and with ``queued`` requests, has been given its name."""
    metrics, clock = EngineMetrics("m", 0, "chunked"), Clock()
    tenants = TenantMetrics(metrics, clock)
    sched = StubScheduler({tenant: queued})
    tenants.served(tenant, 1000)
    tenants.flush(sched)
    clock.now += RELABEL_S
    tenants.flush(sched)
    return metrics, clock, tenants, sched


def test_a_tenant_that_is_no_longer_among_the_busiest_loses_its_series():
    metrics, clock, tenants, sched = just_named("flood", {"waiting": 40, "running": 8})
    tenants.served("flood", 5)
    clock.now += 1.0
    tenants.flush(sched)
    assert "flood" in labels(metrics, "iterserve_tenant_served_tokens")
    assert "flood" in labels(metrics, "iterserve_tenant_requests_waiting")
    for i in range(NAMED_TENANTS):  # eight others, busier from now on
        tenants.served(f"new{i}", 10_000)
    for _ in range(3):
        clock.now += RELABEL_S
        tenants.flush(sched)
    for family in ("iterserve_tenant_served_tokens", "iterserve_tenant_requests_waiting",
                   "iterserve_tenant_requests_running"):  # fmt: skip
        assert "flood" not in labels(metrics, family)
    assert labels(metrics, "iterserve_tenant_requests_waiting") == {OTHER}


def test_a_named_tenant_with_nothing_waiting_reads_zero_rather_than_no_data():
    """A dashboard queried just after a load ends finds the gauges at 0."""
    metrics, clock, tenants, sched = just_named("chat", {"waiting": 3, "running": 2})
    sched.tenants = {}  # the load ended
    clock.now += REFRESH_S
    tenants.flush(sched)
    for family in ("iterserve_tenant_requests_waiting", "iterserve_tenant_requests_running"):
        assert by_tenant(metrics, family) == {"chat": 0.0, OTHER: 0.0}


def test_a_first_token_past_its_target_is_counted_for_its_tenant():
    metrics = EngineMetrics("m", 0, "chunked")
    tenants = TenantMetrics(metrics, Clock())
    late = Request("r", [1, 2], SamplingParams(), tenant="chat", ttft_deadline=1.0)
    on_time = Request("s", [1, 2], SamplingParams(), tenant="chat", ttft_deadline=9.0)
    tenants.first_token(late, 2.0, now=2.0)
    tenants.first_token(on_time, 2.0, now=2.0)
    assert tenants.missed == {"chat": 1}
    missed = [s for n, _, _, ss in metrics.snapshot() if n == "iterserve_tenant_ttft_slo_missed"
              for s in ss]  # fmt: skip
    assert [(s[1]["tenant"], s[2]) for s in missed] == [(OTHER, 1.0)]


def test_a_tenants_missed_targets_read_zero_before_the_first_miss():
    """The dashboard's rate of misses reads 0, not "no data", for a tenant that has
    only met its targets."""
    metrics = EngineMetrics("m", 0, "chunked")
    tenants = TenantMetrics(metrics, Clock())
    tenants.first_token(Request("s", [1, 2], SamplingParams(), tenant="chat"), 0.1, now=0.1)
    missed = [s for n, _, _, ss in metrics.snapshot() if n == "iterserve_tenant_ttft_slo_missed"
              for s in ss]  # fmt: skip
    assert [(s[1]["tenant"], s[2]) for s in missed] == [(OTHER, 0.0)]
