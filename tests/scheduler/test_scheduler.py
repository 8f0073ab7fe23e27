"""Targeted scheduler behaviours: admission, abort, preemption, padding, slab."""

from __future__ import annotations

import pytest

from iterserve.scheduler import (
    FakeExecutor,
    FinishReason,
    PromptTooLongError,
    ProtocolError,
    QueueFullError,
    Request,
    RequestStatus,
    SamplingParams,
    SamplingParamsError,
    Scheduler,
    SchedulerConfig,
)
from iterserve.scheduler.messages import ScheduledSeq, StepPlan, StepResult
from iterserve.scheduler.seq_table import PlanMismatchError
from tests.scheduler.driver import Arrival, one_step, prompt_for, released_ahead_ids, run


def make(policy="continuous", **kw) -> Scheduler:
    defaults = dict(
        policy=policy,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=32,
        block_size=4,
        num_kv_blocks=64,
        batch_timeout_s=0.0,
        batch_wait_s=0.0,
    )
    defaults.update(kw)
    return Scheduler(SchedulerConfig(**defaults))


def req(request_id, n=5, max_tokens=8, priority=0, t=0.0):
    # Its own prompt: requests share no prefix here (prefix caching has its own tests).
    return Request(
        request_id,
        prompt_for(request_id, n),
        SamplingParams(max_tokens=max_tokens),
        arrival_time=t,
        priority=priority,
    )


step = one_step


def test_queue_bound_refuses_with_queue_full_and_leaves_no_trace():
    sched = make(max_queue_len=2)
    sched.add_request(req("a"))
    sched.add_request(req("b"))
    with pytest.raises(QueueFullError, match="queue is full"):
        sched.add_request(req("c"))
    assert "c" not in sched.requests
    assert sched.stats()["num_waiting"] == 2


def test_prompt_too_long_names_both_sizes():
    sched = make(max_model_len=16)
    with pytest.raises(PromptTooLongError, match="16 tokens") as info:
        sched.add_request(req("a", n=16))
    assert info.value.num_prompt_tokens == 16 and info.value.max_model_len == 16


def test_max_tokens_is_clamped_to_the_room_left_in_context():
    sched = make(max_model_len=16)
    request = req("a", n=10, max_tokens=100)
    sched.add_request(request)
    assert request.params.max_tokens == 6


def test_duplicate_and_empty_requests_are_refused():
    sched = make()
    sched.add_request(req("a"))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("a"))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("b", [], SamplingParams()))


def test_config_caps_on_n_and_logprobs():
    sched = make(max_n=2, max_logprobs=5)
    with pytest.raises(SamplingParamsError, match=r"n: must be in \[1, 2\]"):
        sched.add_request(Request("a", [1], SamplingParams(n=3)))
    with pytest.raises(SamplingParamsError, match="logprobs"):
        sched.add_request(Request("b", [1], SamplingParams(logprobs=6)))


@pytest.mark.parametrize("policy", ["static", "dynamic", "continuous", "chunked"])
@pytest.mark.parametrize("when", ["waiting", "running", "in_flight"])
def test_abort_in_any_state_frees_slot_and_blocks(policy, when):
    sched = make(policy)
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(req("a", max_tokens=20))
    sched.add_request(req("b", max_tokens=20))
    if when == "waiting":
        out = sched.abort("a")
    elif when == "running":
        step(sched, executor)
        out = sched.abort("a")
    else:
        scheduled = sched.schedule(0.0)
        out = sched.abort("a")
        outputs = sched.update(executor.execute(scheduled.plan)).outputs
        assert all(o.request_id != "a" for o in outputs)
    assert out.finish_reason is FinishReason.ABORT
    assert "a" not in sched.blocks.tables
    assert all(sched.slots.owner(i) != "a" for i in range(4))
    sched.check_integrity()
    while sched.has_work:
        step(sched, executor)
    assert sched.blocks.num_used == 0 and sched.slots.num_used == 0
    assert sched.abort("a") is None  # aborting twice is harmless


@pytest.mark.parametrize("policy", ["continuous", "chunked"])
def test_preemption_keeps_tokens_and_picks_lowest_priority_latest_arrival(policy):
    # 12 blocks of 4 tokens; three sequences that each grow to 28 tokens cannot all fit.
    sched = make(policy, max_num_seqs=3, num_kv_blocks=12, max_model_len=32)
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(req("high", n=8, max_tokens=20, priority=0, t=0.0))
    sched.add_request(req("low-early", n=8, max_tokens=20, priority=1, t=1.0))
    sched.add_request(req("low-late", n=8, max_tokens=20, priority=1, t=2.0))
    outputs: dict[str, list[int]] = {"high": [], "low-early": [], "low-late": []}
    first_victim = None
    for now in range(400):
        if not sched.has_work:
            break
        _, outs = step(sched, executor, float(now))
        for o in outs:
            outputs[o.request_id].extend(o.new_token_ids)
        if first_victim is None and sched.num_preemptions:
            first_victim = next(
                r.request_id for r in sched.requests.values() if r.status == RequestStatus.PREEMPTED
            )
        sched.check_integrity()
    assert sched.num_preemptions >= 1
    assert first_victim == "low-late"
    for request_id, tokens in outputs.items():
        expected, _ = executor.expected_output(request_id, SamplingParams(max_tokens=20))
        assert tokens == expected


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_static_batch_computes_padding_for_short_prompts_and_dead_slots(policy):
    sched = make(policy)
    lens = {"a": 1, "b": 4}
    executor = FakeExecutor(output_len=lens.__getitem__, block_size=4)
    sched.add_request(req("a", n=2))
    sched.add_request(req("b", n=6))
    plan, _ = step(sched, executor)
    # Padded prefill: both compute 6 positions.
    assert [(s.num_tokens, s.num_pad_tokens) for s in plan.scheduled] == [(2, 4), (6, 0)]
    padding = []
    while sched.has_work:
        plan, _ = step(sched, executor)
        padding.append(len(plan.padding_slots))
    # "a" ended at its first token; its slot is computed as padding until "b" ends.
    assert padding == [1, 1, 1]
    assert sched.slots.num_used == 0


def test_static_waits_for_a_full_batch_until_timeout_and_dynamic_launches_sooner():
    static = make("static", batch_timeout_s=5.0, batch_wait_s=0.5)
    dynamic = make("dynamic", batch_timeout_s=5.0, batch_wait_s=0.5)
    for sched in (static, dynamic):
        sched.add_request(req("a", t=0.0))
    assert static.schedule(1.0) is None and static.next_deadline() == 5.0
    assert dynamic.schedule(1.0) is not None
    assert static.schedule(5.0) is not None


def test_continuous_frees_a_finished_slot_for_a_waiting_request_next_step():
    sched = make("continuous", max_num_seqs=1)
    executor = FakeExecutor(output_len={"a": 2, "b": 2}.__getitem__, block_size=4)
    sched.add_request(req("a"))
    sched.add_request(req("b"))
    step(sched, executor)  # a: prefill + first token
    step(sched, executor)  # a: EOS
    plan, _ = step(sched, executor)
    assert [n.label for n in plan.new_seqs] == ["b"]


def test_chunked_cuts_a_long_prompt_and_never_stalls_running_decodes():
    sched = make("chunked", max_num_batched_tokens=8, max_model_len=64, max_num_seqs=4)
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(req("short", n=3, max_tokens=30))
    step(sched, executor)
    sched.add_request(req("long", n=40, max_tokens=4))
    pieces = []
    while "long" in sched.requests and sched.requests["long"].is_decoding is False:
        plan, _ = step(sched, executor)
        assert any(s.num_tokens == 1 and s.sample for s in plan.scheduled)  # the decode ran
        pieces += [s.num_tokens for s in plan.scheduled if s.num_tokens > 1]
    assert sum(pieces) == 40 and max(pieces) <= 7


def test_slab_layout_reserves_max_model_len_at_admission():
    sched = make("continuous", kv_layout="slab", max_model_len=32, block_size=4, num_kv_blocks=16)
    executor = FakeExecutor(output_len=None, block_size=4)
    for name in "abc":
        sched.add_request(req(name, n=2))
    plan, _ = step(sched, executor)
    # Each admitted sequence holds 8 blocks (32 tokens) however short: only two fit.
    assert len(plan.new_seqs) == 2
    assert all(len(s.new_block_ids) == 8 for s in plan.scheduled)


def test_run_helper_finishes_every_request_exactly():
    config = SchedulerConfig(
        policy="chunked",
        max_num_seqs=2,
        max_num_batched_tokens=4,
        max_model_len=16,
        block_size=2,
        num_kv_blocks=8,
    )
    arrivals = [Arrival(f"r{i}", i, 5, 6, 3 + i % 3) for i in range(6)]
    executor = FakeExecutor(output_len={a.request_id: a.output_len for a in arrivals}.__getitem__)
    log = run(Scheduler(config), executor, arrivals)
    assert all(len(log.outputs[a.request_id]) == a.output_len for a in arrivals)


# -- scheduling ahead: a plan built while the step before it is in flight -------------------


def test_a_sequence_reaching_max_tokens_hands_its_slot_on_in_the_plan_built_ahead():
    sched = make("continuous", max_num_seqs=1)
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(req("a", max_tokens=2))
    sched.add_request(req("b", max_tokens=2))
    first = sched.schedule(0.0)  # a: prefill, samples its first token
    result = executor.execute(first.plan)
    ahead = sched.schedule(0.0)  # a: decode of its last token
    assert ahead.plan.ahead and [s.sample for s in ahead.plan.scheduled] == [True]
    sched.update(result)
    later = executor.execute(ahead.plan)
    # Built while a's last token is still being sampled: a is released ahead, b takes its slot.
    third = sched.schedule(0.0)
    assert "a" in released_ahead_ids(sched) and [n.label for n in third.plan.new_seqs] == ["b"]
    assert sched.blocks.table("a") == [] and sched.slots.owner(0) == "b"
    sched.check_integrity()
    outputs = {o.request_id: o for o in sched.update(later).outputs}
    assert outputs["a"].finish_reason == FinishReason.LENGTH and not sched.released_ahead
    sched.update(executor.execute(third.plan))
    sched.check_integrity()


def test_update_pairs_a_result_with_the_oldest_step_in_flight_and_nothing_else():
    sched = make("continuous", max_num_seqs=2)
    executor = FakeExecutor(output_len=None, block_size=4)
    with pytest.raises(ProtocolError, match="no step is in flight"):
        sched.update(StepResult(step=1))
    sched.add_request(req("a", max_tokens=4))
    first = sched.schedule(0.0)
    ahead = sched.schedule(0.0)
    first_result, ahead_result = executor.execute(first.plan), executor.execute(ahead.plan)
    with pytest.raises(ProtocolError, match="expected 1"):
        sched.update(ahead_result)  # the oldest step in flight is the first
    assert sched.update(first_result) is first and first.outputs[0].request_id == "a"
    assert sched.update(ahead_result) is ahead and sched.num_in_flight == 0
    sched.check_integrity()


def test_a_scheduler_that_does_not_schedule_ahead_builds_one_step_at_a_time():
    sched = Scheduler(make().config, ahead=False)
    sched.add_request(req("a", max_tokens=4))
    assert sched.schedule(0.0) is not None and sched.schedule(0.0) is None
    sched.drop_in_flight()  # the engine stops serving: nothing will collect it
    assert sched.num_in_flight == 0


def test_the_step_after_an_unforeseen_eos_computes_that_sequence_as_padding():
    sched = make("continuous", max_num_seqs=2)
    executor = FakeExecutor(output_len={"a": 1, "b": None}.__getitem__, block_size=4)
    sched.add_request(req("a", max_tokens=8))
    sched.add_request(req("b", max_tokens=8))
    first = sched.schedule(0.0)
    result = executor.execute(first.plan)  # a samples EOS
    ahead = sched.schedule(0.0)  # the scheduler does not know yet: both decode
    assert len(ahead.plan.scheduled) == 2
    outputs = {o.request_id: o for o in sched.update(result).outputs}
    assert outputs["a"].finish_reason == FinishReason.EOS
    after = executor.execute(ahead.plan)
    assert after.num_tokens == 1 and after.num_padding_tokens == 1
    assert [t.seq_id for t in after.sampled] == [sched.requests["b"].seq_id]
    sched.update(after)  # a's row is not a missing token
    sched.check_integrity()
    assert sched.blocks.num_used == len(sched.blocks.table("b"))


def test_only_a_plan_built_ahead_may_name_a_sequence_that_has_ended():
    executor = FakeExecutor(output_len=1, block_size=4)
    sched = make("continuous", max_num_seqs=1)
    sched.add_request(req("a", max_tokens=8))
    plan = sched.schedule(0.0).plan
    executor.execute(plan)  # a ends by EOS
    stale = StepPlan(step=2, scheduled=[ScheduledSeq(plan.scheduled[0].slot_idx, 5, 1, [], True)])
    with pytest.raises(PlanMismatchError, match="holds no sequence"):
        executor.execute(stale)


def test_a_plan_that_would_preempt_is_not_built_ahead():
    # Two 8-token prompts in 4-token blocks, 3 blocks to spare: both get their third
    # block at position 8, and at position 12 only one of them can have a fourth.
    sched = make("continuous", max_num_seqs=2, block_size=4, num_kv_blocks=7, max_model_len=16)
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(req("a", n=8, max_tokens=8))
    sched.add_request(req("b", n=8, max_tokens=8, t=1.0))
    current = sched.schedule(0.0)
    result = executor.execute(current.plan)
    for _ in range(4):  # decodes at positions 8-11, each built ahead
        ahead = sched.schedule(0.0)
        assert ahead.plan.ahead
        sched.update(result)
        current, result = ahead, executor.execute(ahead.plan)
    assert sched.blocks.num_free == 1
    assert sched.schedule(0.0) is None  # would need a preemption: wait for the result
    sched.update(result)
    plan = sched.schedule(0.0).plan  # one step at a time, it preempts the latest arrival
    assert not plan.ahead and sched.num_preemptions == 1
    sched.check_integrity()


def test_lost_steps_requeue_sequences_released_ahead_with_every_token_they_have():
    sched = make("continuous", max_num_seqs=2)
    executor = FakeExecutor(output_len=None, block_size=4)
    sched.add_request(req("a", max_tokens=2))
    sched.add_request(req("b", max_tokens=6))
    tokens = {"a": [], "b": []}
    for out in step(sched, executor)[1]:
        tokens[out.request_id] += out.new_token_ids
    sched.schedule(0.0)  # in flight: a's last token, b's second
    ahead = sched.schedule(0.0)  # built ahead: a is released ahead, b decodes again
    assert ahead.plan.ahead and "a" in released_ahead_ids(sched) and sched.num_in_flight == 2
    sched.requeue_running()  # the ranks died with both steps
    assert sched.num_in_flight == 0 and not sched.released_ahead and not sched.running
    for request in sched.requests.values():
        assert request.status == RequestStatus.PREEMPTED
        assert request.num_output_tokens == 1 and request.num_pending == 0
    sched.check_integrity()
    fresh = FakeExecutor(output_len=None, block_size=4)  # recompute on new workers
    while sched.has_work:
        for out in step(sched, fresh)[1]:
            tokens[out.request_id] += out.new_token_ids
    for request_id, max_tokens in (("a", 2), ("b", 6)):
        expected, _ = fresh.expected_output(request_id, SamplingParams(max_tokens=max_tokens))
        assert tokens[request_id] == expected
    assert sched.blocks.num_used == 0 and sched.slots.num_used == 0


@pytest.mark.parametrize("priority", ["high", None, 1.5, True])
def test_a_request_refused_for_its_priority_leaves_no_trace(priority):
    """A priority the queue cannot order is refused before anything is registered:
    the requests before and after it are served as if it had never come."""
    sched = make()
    sched.add_request(req("a"))
    with pytest.raises(ValueError, match="priority"):
        sched.add_request(req("bad", priority=priority))
    assert "bad" not in sched.requests and sched.stats()["num_waiting"] == 1
    sched.add_request(req("b", priority=-3))
    fake = FakeExecutor(vocab_size=100, output_len=3, block_size=4)
    finished = []
    while sched.has_work:
        _, outputs = step(sched, fake)
        finished += [out.request_id for out in outputs if out.finished]
        sched.check_integrity()
    assert finished == ["b", "a"]  # b's priority value is lower: served first
