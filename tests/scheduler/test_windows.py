"""Sliding windows: the scheduler hands on the KV blocks no layer can read any more."""

from __future__ import annotations

import pytest

from iterserve.scheduler import FakeExecutor, Request, SamplingParams, Scheduler, SchedulerConfig
from iterserve.scheduler.blocks import blocks_for
from tests.scheduler.driver import prompt_for

WINDOW, BS = 16, 4


def windowed(policy="chunked", **kw) -> tuple[Scheduler, FakeExecutor]:
    config = dict(policy=policy, max_num_seqs=4, max_num_batched_tokens=37, max_model_len=512,
                  block_size=BS, num_kv_blocks=256, batch_timeout_s=0.0, batch_wait_s=0.0)  # fmt: skip
    config.update(kw)
    sched = Scheduler(SchedulerConfig(**config), kv_window=WINDOW)
    # check_kv: every position an entry attends to holds its own sequence's KV, so a
    # block handed on while still in some window would fail the step it is reused in.
    executor = FakeExecutor(vocab_size=128, block_size=BS, check_kv=True, kv_window=WINDOW)
    return sched, executor


def drive(sched: Scheduler, executor: FakeExecutor, requests: list[Request]):
    """Runs to the end, checking integrity each step; the outputs, and the blocks
    used after each step."""
    for r in requests:
        sched.add_request(r)
    outputs = {r.request_id: [] for r in requests}
    used = []
    while sched.has_work:
        step = sched.schedule(0.0)
        for out in sched.update(executor.execute(step.plan)).outputs:
            outputs[out.request_id].extend(out.new_token_ids)
        sched.check_integrity()
        used.append(sched.blocks.num_used)
    assert sched.blocks.num_used == 0
    return outputs, used


def expected(executor: FakeExecutor, request: Request) -> list[int]:
    return executor.expected_output(request.request_id, request.params)[0]


@pytest.mark.parametrize("policy", ["continuous", "chunked", "static"])
def test_a_long_generation_holds_the_window_not_the_length(policy):
    sched, executor = windowed(policy, max_num_batched_tokens=512)
    long = Request("long", prompt_for("long", 40), SamplingParams(max_tokens=400))
    outputs, used = drive(sched, executor, [long])
    assert outputs["long"] == expected(executor, long)
    # The prompt's step holds its 10 blocks (its rows read them all); from then on
    # a decode reads its window, which spans at most blocks_for(WINDOW) + 1 blocks.
    # 440 positions would take 110.
    decoding = used[1:-1]  # the last step's update released everything
    if policy == "static":  # its worst case is reserved up front, then handed on
        assert used[0] == blocks_for(440, BS)
        assert decoding[-1] <= blocks_for(WINDOW, BS) + 1
    else:
        assert used[0] == blocks_for(40, BS)
        assert max(decoding) <= blocks_for(WINDOW, BS) + 1


def test_no_window_keeps_every_block():
    sched, executor = windowed()
    sched.blocks.window = None  # a model with a full-attention layer
    executor.kv_window = executor.table.kv_window = None
    long = Request("long", prompt_for("long", 40), SamplingParams(max_tokens=100))
    _, used = drive(sched, executor, [long])
    assert max(used) == blocks_for(140, BS)


def test_handed_on_prefix_blocks_stay_cached_for_the_next_request():
    """A chat's next turn: the first request's early blocks left its table as its
    window moved on, but keep their hash; the next request starts on them, and the
    KV it reads there is its own prefix's."""
    sched, executor = windowed()
    first = Request("turn1", prompt_for("chat", 60), SamplingParams(max_tokens=6))
    drive(sched, executor, [first])
    history = first.prompt_token_ids + first.output_token_ids
    second = Request("turn2", history + prompt_for("more", 9), SamplingParams(max_tokens=6))
    outputs, _ = drive(sched, executor, [second])
    assert outputs["turn2"] == expected(executor, second)
    assert second.num_cached_tokens >= 56  # whole blocks of the first turn


def test_preempted_windowed_sequences_recompute_to_the_same_tokens():
    """Six prompts part-way through prefill on 16 blocks (a window needs 5): some are
    preempted, hand every block back, and are recomputed from their tokens."""
    sched, executor = windowed("chunked", num_kv_blocks=16, max_model_len=64,
                               max_num_batched_tokens=37, max_num_partial_prefills=3)  # fmt: skip
    requests = [Request(f"r{i}", prompt_for(f"r{i}", 34), SamplingParams(max_tokens=20))
                for i in range(6)]  # fmt: skip
    outputs, _ = drive(sched, executor, requests)
    assert sched.num_preemptions > 0
    for r in requests:
        assert outputs[r.request_id] == expected(executor, r)
