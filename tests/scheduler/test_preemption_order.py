"""Preemption frees blocks from the worst running sequence, and never admits in
the same step: who runs is decided by (priority, arrival) across decodes and
prefills alike."""

from __future__ import annotations

from iterserve.scheduler import FakeExecutor, Request, SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.driver import one_step


def _entries(sched: Scheduler, plan) -> list[tuple[str, int, int]]:
    by_slot = {r.slot_idx: r.request_id for r in sched.running.values()}
    return [(by_slot[e.slot_idx], e.start_pos, e.num_tokens) for e in plan.scheduled]


def test_a_worse_decode_gives_way_to_a_better_prompt_part_way_through_prefill():
    # 3 blocks of 4 tokens. 'low' (priority 1) decodes; 'high' (priority 0) takes the
    # last two free blocks for the first piece of its prompt. Next step 'low' needs a
    # new block and none is free: 'low' is the worst running sequence, so it goes.
    sched = Scheduler(
        SchedulerConfig(
            policy="chunked",
            max_num_seqs=2,
            max_num_batched_tokens=8,
            max_model_len=12,
            block_size=4,
            num_kv_blocks=3,
        )
    )
    fake = FakeExecutor(vocab_size=100, output_len=None, block_size=4)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    sched.add_request(Request("low", [5, 6, 7], params, arrival_time=0.0, priority=1))
    one_step(sched, fake, 0.0)
    sched.add_request(Request("high", list(range(10, 21)), params, arrival_time=1.0, priority=0))
    plan, _ = one_step(sched, fake, 1.0)
    assert _entries(sched, plan) == [("low", 3, 1), ("high", 0, 7)]
    assert sched.blocks.num_free == 0

    scheduled = sched.schedule(2.0)
    assert _entries(sched, scheduled.plan) == [("high", 7, 4)]
    assert sched.requests["low"].num_preemptions == 1
    assert sched.requests["high"].num_preemptions == 0
    sched.update(fake.execute(scheduled.plan))
    sched.check_integrity()


def test_no_request_is_admitted_in_a_step_that_preempted():
    # 3 blocks of 4 tokens: 'a' holds one, 'b' two. Both reach a block edge in the
    # same step; 'b' (later) is preempted and frees two, 'a' takes one. The free one
    # would fit the newly arrived, urgent 'c', but a step that preempted admits nobody.
    sched = Scheduler(
        SchedulerConfig(
            policy="continuous",
            max_num_seqs=4,
            max_num_batched_tokens=32,
            max_model_len=12,
            block_size=4,
            num_kv_blocks=3,
        )
    )
    fake = FakeExecutor(vocab_size=100, output_len=None, block_size=4)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    sched.add_request(Request("a", [5, 6, 7], params, arrival_time=0.0))
    sched.add_request(Request("b", [5, 6, 7, 8, 9, 10, 11], params, arrival_time=0.5))
    one_step(sched, fake, 0.0)  # both prefill
    one_step(sched, fake, 1.0)  # a decodes @3, b @7
    sched.add_request(Request("c", [5, 6], params, arrival_time=1.5, priority=-1))
    scheduled = sched.schedule(2.0)
    assert _entries(sched, scheduled.plan) == [("a", 4, 1)]
    assert scheduled.plan.new_seqs == []
    assert sched.requests["b"].num_preemptions == 1
    sched.update(fake.execute(scheduled.plan))
    sched.check_integrity()
