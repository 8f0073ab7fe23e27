"""scheduling_policy: priority (unchanged), fcfs, and fair between tenants."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.scheduler import (
    FakeExecutor,
    QueueFullError,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from iterserve.scheduler.config import SCHEDULING_POLICIES
from tests.scheduler import golden
from tests.scheduler import test_adapters as adapters
from tests.scheduler.driver import Arrival, run
from tests.scheduler.test_properties import PERIODS, VOCAB, check_workload, workloads

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TENANTS = ("a", "b", "c", "d")


@st.composite
def fair_workloads(draw, ahead: bool | None = None):
    """A workload of continuous or chunked batching whose requests belong to up to
    four tenants (weights 1-3, some with a first-token target), under fair."""
    policy = draw(st.sampled_from(["continuous", "chunked"]))
    config, arrivals, kv_window = draw(workloads(policy))
    names = TENANTS[: draw(st.integers(1, len(TENANTS)))]
    tenants = {name: {"weight": draw(st.sampled_from([1, 1, 2, 3]))} for name in names}
    for arrival in arrivals:
        arrival.tenant = draw(st.sampled_from(names))
        arrival.slo_steps = draw(st.one_of(st.none(), st.none(), st.integers(1, 30)))
    config = dataclasses.replace(config, scheduling_policy="fair", tenants=tenants)
    return config, arrivals, kv_window


def executor_for(config, arrivals, kv_window) -> FakeExecutor:
    return FakeExecutor(
        vocab_size=VOCAB,
        output_len={a.request_id: a.output_len for a in arrivals}.__getitem__,
        block_size=config.block_size,
        kv_window=kv_window if config.kv_layout == "paged" else None,
    )


def plans_of(config, arrivals, kv_window=None, ahead=False) -> list:
    """Every plan of a run, as plain data."""
    executor = executor_for(config, arrivals, kv_window)
    plans: list = []
    sched = Scheduler(config, kv_window=kv_window)
    run(sched, executor, arrivals, ahead=ahead, on_plan=lambda p: plans.append(golden._plain(p)))
    return plans


# -- priority and fcfs ---------------------------------------------------------------


def test_priority_gives_the_plans_it_gave_before_scheduling_policy_existed():
    def make(config, ahead):
        return Scheduler(SchedulerConfig(**config), ahead=ahead)

    digest = golden.plans_digest(make, lambda sched, step, result: sched.update(result).outputs)
    assert digest == golden.PRIORITY_DIGEST


@SETTINGS
@given(st.sampled_from(["static", "dynamic", "continuous", "chunked"]).flatmap(workloads),
       st.data())  # fmt: skip
def test_under_priority_and_fcfs_a_tenant_changes_nothing(workload, data):
    config, arrivals, kv_window = workload
    policy = data.draw(st.sampled_from(["priority", "fcfs"]))
    config = dataclasses.replace(config, scheduling_policy=policy)
    plain = plans_of(config, [dataclasses.replace(a) for a in arrivals], kv_window)
    for arrival in arrivals:
        arrival.tenant = data.draw(st.sampled_from(TENANTS))
    assert plans_of(config, arrivals, kv_window) == plain


@SETTINGS
@given(st.sampled_from(["static", "dynamic", "continuous", "chunked"]).flatmap(workloads))
def test_fcfs_is_priority_with_every_priority_equal(workload):
    config, arrivals, kv_window = workload
    fcfs = plans_of(dataclasses.replace(config, scheduling_policy="fcfs"),
                    [dataclasses.replace(a) for a in arrivals], kv_window)  # fmt: skip
    for arrival in arrivals:
        arrival.priority = 0
    assert fcfs == plans_of(config, arrivals, kv_window)


# -- fair: properties ------------------------------------------------------------------


@SETTINGS
@given(st.sampled_from(["continuous", "chunked"]).flatmap(workloads), st.booleans())
def test_with_one_tenant_fair_plans_exactly_what_priority_plans(workload, ahead):
    """What fair costs a single tenant is its waiting bound alone: with room for
    every request, its plans are priority's, bit for bit."""
    config, arrivals, kv_window = workload
    priority = plans_of(config, [dataclasses.replace(a) for a in arrivals], kv_window, ahead)
    config = dataclasses.replace(
        config, scheduling_policy="fair", max_queue_len_per_tenant=config.max_queue_len
    )
    assert plans_of(config, arrivals, kv_window, ahead) == priority


@SETTINGS
@given(fair_workloads(), st.booleans())
def test_fair_keeps_every_invariant_and_output(workload, ahead):
    """Integrity (per-tenant queues included) after every step, every output exact,
    nothing leaked, with and without scheduling ahead."""
    check_workload(*workload, ahead=ahead)


@SETTINGS
@given(fair_workloads(), st.booleans())
def test_fair_counters_never_run_backwards_and_no_tenant_starves(workload, ahead):
    """Every tenant's counter only grows; a tenant with requests waiting gets a
    row in a plan within a bound of steps: the steps one request can hold a slot
    (its prompt in pieces, its tokens, a recompute), once per other tenant."""
    config, arrivals, kv_window = workload
    executor = executor_for(config, arrivals, kv_window)
    sched = Scheduler(config, kv_window=kv_window)
    seen: dict[str, float] = {}
    unserved: dict[str, int] = {}
    longest = 0
    num_tenants = len({a.tenant for a in arrivals})
    bound = num_tenants * 3 * (config.max_model_len + 2)

    def watch(plan) -> None:
        nonlocal longest
        counters = sched.waiting.counters()
        for name, counter in counters.items():
            assert counter >= seen.get(name, 0.0), f"{name}: {seen[name]} -> {counter}"
        seen.update(counters)
        served = {sched.requests[sched.slots.owner(e.slot_idx)].tenant
                  for e in plan.scheduled if sched.slots.owner(e.slot_idx) in sched.requests}  # fmt: skip
        waiting = {r.tenant for r in sched.requests.values() if r.slot_idx < 0}
        for name in TENANTS:
            unserved[name] = unserved.get(name, 0) + 1 if name in waiting - served else 0
            longest = max(longest, unserved[name])

    run(sched, executor, arrivals, ahead=ahead, on_plan=watch)
    assert longest <= bound, f"a tenant waited {longest} steps unserved (bound {bound})"


@SETTINGS
@given(st.sampled_from(["continuous", "chunked"]).flatmap(
    lambda policy: workloads(policy, speculative=True)), PERIODS,
    st.sampled_from(SCHEDULING_POLICIES), st.data())  # fmt: skip
def test_speculation_keeps_its_outputs_under_every_scheduling_policy(
    workload, period, policy, data
):
    config, arrivals, kv_window = workload
    for arrival in arrivals:
        arrival.tenant = data.draw(st.sampled_from(TENANTS))
    config = dataclasses.replace(config, scheduling_policy=policy)
    check_workload(config, arrivals, kv_window, period=period, ahead=data.draw(st.booleans()))


@settings(max_examples=40, deadline=None)
@given(
    loras=st.lists(st.sampled_from(["a", "b", "c", None]), min_size=1, max_size=12),
    tenants=st.lists(st.sampled_from(TENANTS), min_size=12, max_size=12),
    max_loras=st.integers(1, 3),
    policy=st.sampled_from(SCHEDULING_POLICIES),
)
def test_lora_residency_holds_under_every_scheduling_policy(loras, tenants, max_loras, policy):
    sched = adapters.make(max_loras=max_loras, num_kv_blocks=24, scheduling_policy=policy)
    for i, lora in enumerate(loras):
        request = adapters.req(f"r{i}", lora=lora, n=3 + 2 * i, max_tokens=5, t=float(i))
        request.tenant = tenants[i]
        sched.add_request(request)
    slots: dict[int, int] = {}
    for plan in adapters.run(sched, FakeExecutor(block_size=4), steps=2000):
        assert len(adapters.adapters_in(plan, slots)) <= max_loras
    assert not sched.has_work and not sched.adapters.pins


# -- fair: behaviours ------------------------------------------------------------------


def fair(**kw) -> Scheduler:
    defaults = dict(
        policy="chunked",
        scheduling_policy="fair",
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=256,
        block_size=4,
        num_kv_blocks=512,
    )
    defaults.update(kw)
    return Scheduler(SchedulerConfig(**defaults))


def request(request_id, tenant, n=8, max_tokens=4, t=0.0, priority=0, deadline=None):
    prompt = [3 + (hash(request_id) + 7 * i) % 90 for i in range(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(request_id, prompt, params, arrival_time=t, priority=priority,
                   tenant=tenant, ttft_deadline=deadline)  # fmt: skip


def step(sched, executor, now=0.0):
    scheduled = sched.schedule(now)
    if scheduled is not None:
        sched.update(executor.execute(scheduled.plan))
    sched.check_integrity()
    return scheduled


def tenants_of(sched, scheduled) -> list[str]:
    return [scheduled.requests[e.slot_idx].tenant for e in scheduled.plan.scheduled]


def test_a_light_tenant_starts_in_the_next_step_behind_a_flood():
    sched = fair()
    executor = FakeExecutor(output_len=None, block_size=4)
    for i in range(6):
        sched.add_request(request(f"flood{i}", "flood", n=200, max_tokens=50, t=float(i)))
    for _ in range(3):
        step(sched, executor)  # the flood's first prompt, part-way
    sched.add_request(request("chat", "light", n=10, max_tokens=4, t=10.0))
    scheduled = step(sched, executor, 10.0)
    # Before the flood's running prompt's next piece, which takes what budget is left.
    assert tenants_of(sched, scheduled) == ["light", "flood"]
    entries = {scheduled.requests[e.slot_idx].request_id: e.num_tokens
               for e in scheduled.plan.scheduled}  # fmt: skip
    # The flood's piece shrinks to what the newcomer took: their step stays short.
    assert entries["chat"] == 10 and entries["flood0"] == 10


def test_under_priority_the_same_light_request_waits_for_the_whole_flood():
    sched = fair(scheduling_policy="priority")
    executor = FakeExecutor(output_len=None, block_size=4)
    for i in range(6):
        sched.add_request(request(f"flood{i}", "flood", n=100, max_tokens=50, t=float(i)))
    for _ in range(3):
        step(sched, executor)
    sched.add_request(request("chat", "light", n=10, max_tokens=4, t=10.0))
    scheduled = step(sched, executor, 10.0)
    assert "light" not in tenants_of(sched, scheduled)


def test_weights_share_the_tokens_of_two_backlogged_tenants_two_to_one():
    sched = fair(tenants={"gold": {"weight": 2}, "bronze": {"weight": 1}}, max_num_seqs=4)
    executor = FakeExecutor(output_len=None, block_size=4)
    for i in range(40):
        sched.add_request(request(f"g{i}", "gold", n=40, max_tokens=8, t=float(i)))
        sched.add_request(request(f"b{i}", "bronze", n=40, max_tokens=8, t=float(i)))
    served = {"gold": 0, "bronze": 0}
    for _ in range(120):
        scheduled = step(sched, executor)
        for e in scheduled.plan.scheduled:
            served[scheduled.requests[e.slot_idx].tenant] += e.num_tokens
    assert 1.8 <= served["gold"] / served["bronze"] <= 2.2, served
    counters = sched.waiting.counters()
    assert abs(counters["gold"] - counters["bronze"]) <= 2 * 32 + 8 * 40


def test_a_tenant_returning_from_idle_is_lifted_to_those_waiting():
    sched = fair(max_num_seqs=2)
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(request("early", "a", n=8, max_tokens=1))
    while sched.has_work:
        step(sched, executor)
    for i in range(6):  # b keeps requests waiting: two run at a time
        sched.add_request(request(f"b{i}", "b", n=40, max_tokens=20, t=float(i)))
    for _ in range(20):
        step(sched, executor)
    counters = sched.waiting.counters()
    assert counters["b"] > counters["a"]
    sched.add_request(request("back", "a", t=30.0))
    assert sched.waiting.counters()["a"] == counters["b"]  # no credit for its idle time


def test_the_victim_of_a_preemption_is_the_most_served_tenants():
    sched = fair(num_kv_blocks=24, max_num_seqs=3, max_num_batched_tokens=64,
                 max_model_len=64)  # fmt: skip
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(request("a0", "a", n=30, max_tokens=30, t=0.0))
    sched.add_request(request("b0", "b", n=8, max_tokens=30, t=1.0))
    sched.add_request(request("a1", "a", n=8, max_tokens=30, t=2.0))
    preempted = []
    while sched.has_work and not preempted:
        step(sched, executor)
        preempted = [r for r in sched.requests.values() if r.num_preemptions]
    assert preempted and {r.tenant for r in preempted} == {"a"}


def test_a_flooding_tenant_is_refused_by_name_before_anyone_else():
    sched = fair(max_queue_len=8, max_queue_len_per_tenant=3)
    for i in range(3):
        sched.add_request(request(f"f{i}", "flood"))
    with pytest.raises(QueueFullError, match="tenant 'flood' has 3 requests waiting"):
        sched.add_request(request("f3", "flood"))
    sched.add_request(request("x", "light"))  # another tenant still gets in
    assert "f3" not in sched.requests and "x" in sched.requests


def test_the_whole_waiting_queue_stays_bounded_across_tenants():
    sched = fair(max_queue_len=4, max_queue_len_per_tenant=4)
    for name in "abcd":
        sched.add_request(request(name, name))
    with pytest.raises(QueueFullError, match=r"the waiting queue is full \(4 requests\)"):
        sched.add_request(request("e", "e"))
    assert "e" not in sched.requests


def test_a_due_request_goes_first_among_tenants_within_one_steps_budget():
    sched = fair(max_num_seqs=1)
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(request("a0", "a", t=0.0))
    sched.add_request(request("b0", "b", t=1.0, deadline=5.0))
    first = step(sched, executor)
    assert [n.label for n in first.plan.new_seqs] == ["b0"]


def test_a_deadline_does_not_lift_a_tenant_served_more_than_one_step_ahead():
    # a0 holds the one slot for 40 steps: its tenant's counter runs past b's by more
    # than the budget, so b0 goes next although a1 is already past its deadline.
    sched = fair(max_num_seqs=1)
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(request("a0", "a", n=8, max_tokens=40, t=0.0))
    step(sched, executor)
    sched.add_request(request("b0", "b", t=1.0))
    sched.add_request(request("a1", "a", t=2.0, deadline=0.0))
    admitted = []
    while sched.has_work and len(admitted) < 3:
        admitted += [n.label for n in step(sched, executor).plan.new_seqs]
    counters = sched.waiting.counters()
    assert admitted == ["b0", "a1"] and counters["a"] > counters["b"]


def test_priority_still_orders_requests_inside_a_tenant():
    sched = fair(max_num_seqs=1)
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(request("late_urgent", "a", t=1.0, priority=-1))
    sched.add_request(request("early", "a", t=0.0, priority=0))
    assert [n.label for n in step(sched, executor).plan.new_seqs] == ["late_urgent"]


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_static_and_dynamic_batching_refuse_fair_by_name(policy):
    with pytest.raises(ValueError, match=f"scheduling_policy: fair .* policy '{policy}'"):
        SchedulerConfig(policy=policy, scheduling_policy="fair")


def test_tenant_settings_need_fair_and_name_what_is_wrong():
    with pytest.raises(ValueError, match="tenants: applies to scheduling_policy fair"):
        SchedulerConfig(tenants={"a": {"weight": 2}})
    with pytest.raises(ValueError, match="tenants: a.weight must be a number > 0"):
        SchedulerConfig(scheduling_policy="fair", tenants={"a": {"weight": 0}})
    with pytest.raises(ValueError, match="tenants: 'a' must be a mapping of weight, ttft_slo_ms"):
        SchedulerConfig(scheduling_policy="fair", tenants={"a": {"share": 2}})


def test_a_tenants_own_first_token_target_becomes_its_requests_deadline():
    sched = fair(tenants={"chat": {"ttft_slo_ms": 250}})
    sched.add_request(request("c", "chat", t=2.0))
    sched.add_request(request("x", "batch", t=2.0))
    assert sched.requests["c"].ttft_deadline == 2.25
    assert sched.requests["x"].ttft_deadline is None


def test_a_tenant_is_a_bounded_string():
    sched = fair()
    for bad in ("", "x" * 129, 7):
        with pytest.raises(ValueError, match="tenant: must be a string of 1 to 128"):
            sched.add_request(request("r", bad))
    assert not sched.requests


def test_per_tenant_stats():
    sched = fair()
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(request("a0", "a", n=8))
    sched.add_request(request("b0", "b", n=8))
    step(sched, executor)
    stats = sched.tenant_stats()
    assert stats["a"]["running"] == 1 and stats["b"]["running"] == 1
    assert stats["a"]["served"] == 8 and stats["b"]["served"] == 8


def test_fair_arrivals_run_through_the_driver():
    arrivals = [Arrival(f"r{i}", i % 3, 5, 4, 3, tenant=TENANTS[i % 2]) for i in range(6)]
    config = SchedulerConfig(policy="chunked", scheduling_policy="fair", max_num_seqs=2,
                             max_num_batched_tokens=16, max_model_len=32, block_size=4,
                             num_kv_blocks=32)  # fmt: skip
    check_workload(config, arrivals)


def test_tenants_share_cached_prefixes():
    # A tenant is not the cache's isolation key: another tenant's identical prompt
    # starts on the blocks the first one computed.
    sched = fair(tenants={"b": {"weight": 2}})
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(request("a0", "a", n=17, max_tokens=1))
    while sched.has_work:
        step(sched, executor)
    twin = request("a0", "b", n=17, max_tokens=1)  # the same prompt (the id seeds it)
    twin.request_id = twin.label = "b0"
    sched.add_request(twin)
    scheduled = step(sched, executor)
    assert scheduled.plan.new_seqs[0].num_cached_tokens == 16
