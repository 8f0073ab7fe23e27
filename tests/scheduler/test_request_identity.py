"""Results belong to the request they were computed for, whatever its id.

Request ids come from clients; the scheduler cannot trust them to be unique
over time. A step still in flight when its request is aborted must not hand
that request's token, finish or blocks to a new request that reused the id.
"""

from __future__ import annotations

from iterserve.scheduler import FakeExecutor, Request, SamplingParams, Scheduler, SchedulerConfig


def _sched() -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            policy="continuous",
            max_num_seqs=2,
            max_num_batched_tokens=32,
            max_model_len=32,
            block_size=4,
            num_kv_blocks=16,
        )
    )


def _req(request_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_a_reused_id_never_receives_the_aborted_requests_token():
    sched = _sched()
    fake = FakeExecutor(vocab_size=100, output_len=None, block_size=4)
    sched.add_request(_req("x", [5, 6, 7]))
    first = sched.schedule(0.0)
    in_flight = fake.execute(first.plan)  # samples old x's first token
    sched.abort("x")
    fresh = _req("x", [9, 9, 9, 9, 9])
    sched.add_request(fresh)
    ahead = sched.schedule(0.0)  # built while the first step runs: admits the new x
    assert ahead is not None and [n.label for n in ahead.plan.new_seqs] == ["x"]
    outputs = sched.update(in_flight).outputs
    assert all(not out.new_token_ids for out in outputs if out.request_id == "x")
    assert fresh.output_token_ids == []
    outputs = sched.update(fake.execute(ahead.plan)).outputs
    assert [out.new_token_ids for out in outputs] == [fresh.output_token_ids]
    sched.check_integrity()


def test_a_reused_id_does_not_inherit_the_aborted_requests_finish():
    sched = _sched()
    # The old x ends with EOS in the step in flight; its finish record names blocks
    # the scheduler already freed at the abort.
    fake = FakeExecutor(vocab_size=100, output_len=1, block_size=4)
    sched.add_request(_req("x", [5, 6, 7]))
    first = sched.schedule(0.0)
    in_flight = fake.execute(first.plan)
    assert [f.reason for f in in_flight.finished] == ["eos"]
    sched.abort("x")
    fresh = _req("x", [9, 9, 9, 9, 9], max_tokens=3)
    sched.add_request(fresh)
    ahead = sched.schedule(0.0)
    sched.update(in_flight)  # no ProtocolError, and the new x keeps running
    assert fresh.status.name == "RUNNING" and fresh.finish_reason is None
    sched.update(fake.execute(ahead.plan))
    sched.check_integrity()
    assert len(fresh.output_token_ids) == 1
