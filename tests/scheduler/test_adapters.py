"""LoRA adapters as a scheduled resource: at most max_loras distinct adapters per
step, residency pinned by running requests, loads in the plan before their rows,
least recently used eviction, and prefix-cache keys that never cross adapters."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.scheduler import FakeExecutor, Request, SamplingParams, Scheduler, SchedulerConfig
from iterserve.scheduler.adapters import AdapterNotFoundError, AdapterResidency
from iterserve.scheduler.codec import decode, encode
from iterserve.scheduler.messages import StepPlan
from tests.scheduler.driver import one_step, prompt_for


def make(**kw) -> Scheduler:
    defaults = dict(policy="chunked", max_num_seqs=8, max_num_batched_tokens=64,
                    max_model_len=64, block_size=4, num_kv_blocks=128, max_loras=2)  # fmt: skip
    defaults.update(kw)
    sched = Scheduler(SchedulerConfig(**defaults))
    for name in ("a", "b", "c"):
        sched.adapters.register(name, f"/adapters/{name}")
    return sched


def req(request_id, lora=None, n=6, max_tokens=4, t=0.0, prompt=None):
    return Request(request_id, prompt or prompt_for(request_id, n),
                   SamplingParams(max_tokens=max_tokens), arrival_time=t, lora_name=lora)  # fmt: skip


def run(sched, executor, steps=200):
    """Steps to the end; returns every plan, checking integrity after each step."""
    plans = []
    for _ in range(steps):
        plan, _ = one_step(sched, executor)
        if plan is None:
            break
        plan = decode(encode(plan), StepPlan)  # what the ranks receive
        plans.append(plan)
        sched.check_integrity()
    return plans


def adapters_in(plan, slots) -> set[int]:
    """The adapter slots the plan's rows compute with; ``slots`` maps each
    sequence slot to its adapter slot as the ranks learn it."""
    for new in plan.new_seqs:
        slots[new.slot_idx] = new.lora_slot
    return {slots[e.slot_idx] for e in plan.scheduled if slots[e.slot_idx]}


def test_an_unknown_adapter_is_refused_and_leaves_no_trace():
    sched = make()
    with pytest.raises(AdapterNotFoundError):
        sched.add_request(req("x", lora="nope"))
    assert not sched.requests


def test_the_first_step_of_an_adapter_carries_its_load_and_its_rows_name_the_slot():
    sched = make()
    sched.add_request(req("r1", lora="a"))
    sched.add_request(req("r2"))
    executor = FakeExecutor(block_size=4)
    plan, _ = one_step(sched, executor)
    (load,) = plan.adapter_loads
    assert (load.slot, load.name, load.path) == (1, "a", "/adapters/a")
    by_id = {n.label: n.lora_slot for n in plan.new_seqs}
    assert by_id == {"r1": 1, "r2": 0}
    plan, _ = one_step(sched, executor)
    assert plan.adapter_loads == []  # resident now


def test_a_step_mixes_at_most_max_loras_adapters_and_the_third_waits():
    sched = make(max_loras=2)
    for i, lora in enumerate(["a", "b", "c", None, "a"]):
        sched.add_request(req(f"r{i}", lora=lora, max_tokens=6, t=float(i)))
    executor = FakeExecutor(block_size=4)
    slots: dict[int, int] = {}
    plans = run(sched, executor)
    first = plans[0]
    # c's request waited; the base request and a's second one went ahead of it.
    assert {n.label for n in first.new_seqs} == {"r0", "r1", "r3", "r4"}
    for plan in plans:
        assert len(adapters_in(plan, slots)) <= 2
    loads = [load.name for plan in plans for load in plan.adapter_loads]
    assert loads == ["a", "b", "c"]  # c took the slot of whichever went idle first
    assert sched.adapters.num_evictions == 1
    assert not sched.has_work


def test_eviction_takes_the_least_recently_used_idle_adapter():
    res = AdapterResidency(max_loras=2)
    a, b, c = (res.register(n, n) for n in "abc")
    assert res.pin(a) == 1 and res.pin(b) == 2
    res.unpin(b.adapter_id)  # b idle first
    res.unpin(a.adapter_id)  # then a
    assert res.pin(c) == 2  # b's slot
    assert set(res.slot_of) == {a.adapter_id, c.adapter_id}
    assert res.pin(a) == 1 and res.take_loads()[-1].name == "c"


def test_every_slot_pinned_means_no_room():
    res = AdapterResidency(max_loras=1)
    a, b = res.register("a", "a"), res.register("b", "b")
    res.pin(a)
    assert not res.can_pin(b) and res.pin(b) is None
    res.unpin(a.adapter_id)
    assert res.can_pin(b)


def test_an_adapter_unloaded_while_running_keeps_its_slot_until_its_requests_leave():
    sched = make(max_loras=1)
    sched.add_request(req("r1", lora="a", max_tokens=5))
    executor = FakeExecutor(block_size=4)
    one_step(sched, executor)
    sched.adapters.unregister("a")
    with pytest.raises(AdapterNotFoundError):
        sched.add_request(req("r2", lora="a"))
    assert sched.adapters.num_resident == 1
    run(sched, executor)
    assert sched.adapters.num_resident == 0


def test_preemption_unpins_and_recompute_pins_again():
    """Blocks for two sequences only: one is preempted, and its adapter goes idle
    until it is recomputed."""
    sched = make(num_kv_blocks=5, max_model_len=20, max_loras=2)
    sched.add_request(req("r1", lora="a", n=6, max_tokens=12, t=0.0))
    sched.add_request(req("r2", lora="b", n=6, max_tokens=12, t=1.0))
    plans = run(sched, FakeExecutor(block_size=4))
    assert sched.num_preemptions >= 1
    assert not sched.has_work
    assert not sched.adapters.pins and sched.adapters.num_resident <= 2
    assert len(plans) > 1


def test_a_worker_restart_forgets_resident_adapters_and_reloads_them():
    sched = make()
    sched.add_request(req("r1", lora="a", max_tokens=8))
    one_step(sched, FakeExecutor(block_size=4))
    sched.requeue_running()
    assert sched.adapters.num_resident == 0
    plan, _ = one_step(sched, FakeExecutor(block_size=4))  # fresh ranks
    assert [load.name for load in plan.adapter_loads] == ["a"]


def test_prefix_cache_hits_never_cross_adapters():
    sched = make(max_loras=2)
    prompt = prompt_for("shared", 17)
    executor = FakeExecutor(block_size=4)
    sched.add_request(req("base", prompt=prompt))
    run(sched, executor)
    for rid, lora in (("on-a", "a"), ("again-a", "a"), ("on-b", "b"), ("base2", None)):
        sched.add_request(req(rid, lora=lora, prompt=prompt))
        plan, _ = one_step(sched, executor)
        (new,) = plan.new_seqs
        expected = 16 if rid in ("again-a", "base2") else 0
        assert new.num_cached_tokens == expected, rid
        run(sched, executor)


@settings(max_examples=40, deadline=None)
@given(
    loras=st.lists(st.sampled_from(["a", "b", "c", None]), min_size=1, max_size=12),
    max_loras=st.integers(1, 3),
    lengths=st.lists(st.integers(1, 30), min_size=12, max_size=12),
)
def test_any_mix_respects_max_loras_and_ends_with_nothing_pinned(loras, max_loras, lengths):
    sched = make(max_loras=max_loras, num_kv_blocks=24)
    for i, lora in enumerate(loras):
        sched.add_request(req(f"r{i}", lora=lora, n=lengths[i], max_tokens=5, t=float(i)))
    slots: dict[int, int] = {}
    resident: dict[int, str] = {}
    for plan in run(sched, FakeExecutor(block_size=4), steps=2000):
        for load in plan.adapter_loads:
            resident[load.slot] = load.name
        used = adapters_in(plan, slots)
        assert len(used) <= max_loras
        assert used <= set(resident)
    assert not sched.has_work
    assert not sched.adapters.pins
