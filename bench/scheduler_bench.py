"""CPU cost of the scheduler itself: schedule() + update() per step.

The fake executor stands in for the model; only the scheduler's own calls are
timed (process CPU time), with every slot holding a decoding sequence.
"""

from __future__ import annotations

import time

from ..scheduler import FakeExecutor, Request, SamplingParams, Scheduler, SchedulerConfig


def ms_per_step(
    num_seqs: int,
    num_steps: int = 200,
    policy: str = "chunked",
    scheduling_policy: str = "priority",
    num_tenants: int = 1,
) -> float:
    """CPU ms of schedule() + update() per step with ``num_seqs`` sequences decoding,
    spread round-robin over ``num_tenants`` tenants."""
    config = SchedulerConfig(
        policy=policy,
        scheduling_policy=scheduling_policy,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(2048, num_seqs),
        max_model_len=2048,
        block_size=16,
        num_kv_blocks=num_seqs * 128,
    )
    sched = Scheduler(config)
    executor = FakeExecutor(output_len=None, check_blocks=False)
    params = SamplingParams(max_tokens=1500, ignore_eos=True)
    for i in range(num_seqs):
        sched.add_request(Request(f"req-{i}", list(range(3, 35)), params, arrival_time=float(i),
                                  tenant=f"tenant-{i % num_tenants}"))  # fmt: skip
    # Warm up until every sequence has been prefilled and is decoding.
    while not all(r.is_decoding for r in sched.running.values()) or len(sched.running) < num_seqs:
        step = sched.schedule(0.0)
        sched.update(executor.execute(step.plan))
    spent = 0.0
    for _ in range(num_steps):
        t0 = time.process_time()
        step = sched.schedule(0.0)
        t1 = time.process_time()
        result = executor.execute(step.plan)
        t2 = time.process_time()
        sched.update(result)
        t3 = time.process_time()
        spent += (t1 - t0) + (t3 - t2)
    return spent / num_steps * 1000.0


def run() -> dict:
    return {
        "ms_per_step_64": round(ms_per_step(64), 4),
        "ms_per_step_256": round(ms_per_step(256), 4),
        # fair: the same 256 sequences of 4 tenants, each step charged to them.
        "ms_per_step_256_fair": round(ms_per_step(256, scheduling_policy="fair", num_tenants=4), 4),
    }
