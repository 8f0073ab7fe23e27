"""Static batching never drops a request it could not admit."""

from __future__ import annotations

from iterserve.scheduler import FakeExecutor, Request, SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.driver import one_step


def test_a_member_whose_blocks_cannot_be_allocated_waits_for_the_next_batch():
    sched = Scheduler(
        SchedulerConfig(
            policy="static",
            max_num_seqs=2,
            max_num_batched_tokens=64,
            max_model_len=16,
            block_size=4,
            num_kv_blocks=16,
            batch_timeout_s=0.0,
        )
    )
    fake = FakeExecutor(vocab_size=100, output_len=None, block_size=4)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    sched.add_request(Request("a", [5, 6, 7], params, arrival_time=0.0))
    sched.add_request(Request("b", [5, 6, 7], params, arrival_time=1.0))
    allocate = sched.blocks.allocate

    def refuse_b_once(request_id, num_tokens, cached=None):
        if request_id == "b" and not refused:
            refused.append(request_id)
            return None
        return allocate(request_id, num_tokens, cached)

    refused: list[str] = []
    sched.blocks.allocate = refuse_b_once
    finished = set()
    for now in range(20):
        _, outputs = one_step(sched, fake, float(now))
        sched.check_integrity()
        for out in outputs:
            if out.finished:
                finished.add(out.request_id)
    assert refused == ["b"]
    assert finished == {"a", "b"}
    assert not sched.requests
