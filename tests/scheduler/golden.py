"""Seeded workloads whose plans, step by step, pin down the ``priority`` order:
their digest under the scheduler as it was before ``scheduling_policy`` existed
(commit 0ae4e69) is ``PRIORITY_DIGEST``; the same workloads must give the same
plans, bit for bit.

Self-contained on purpose (no driver): the same module ran against that commit,
with ``update`` called as it then was (``update(step, result)``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections import deque
from collections.abc import Callable

PRIORITY_DIGEST = "c1ed9173b753be45e65272b8b4a4e83fb01394794eea90e43600abc018ee8509"
NUM_WORKLOADS = 60
# The plan's fields of that commit (step, new sequences, entries, released and padding
# slots, built ahead, adapter loads): a field added since (KV transfers) is not the order.
PLAN_FIELDS = 7


def _plain(value):
    """Dataclasses to lists, tuples to lists: one JSON text per plan."""
    if dataclasses.is_dataclass(value):
        return [_plain(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def workload(seed: int) -> tuple[dict, bool, list[tuple[int, dict]], dict[str, int]]:
    """(config, schedule ahead?, [(arrival step, request fields)], {request_id: abort step})."""
    rng = random.Random(seed)
    policy = rng.choice(["continuous", "chunked", "chunked", "static", "dynamic"])
    block_size = rng.choice([1, 2, 4, 16])
    max_num_seqs = rng.randint(1, 6)
    max_model_len = rng.randint(8, 40)
    if policy == "chunked":
        budget = rng.randint(max_num_seqs, max_num_seqs + 30)
    else:
        budget = rng.randint(max(max_model_len, max_num_seqs), 2 * max_model_len)
    per_seq = -(-max_model_len // block_size)
    config = dict(
        policy=policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=rng.randint(per_seq, per_seq * (max_num_seqs + 1)),
        max_num_partial_prefills=rng.randint(1, 3),
        long_prefill_token_threshold=rng.choice([0, 0, 4]),
        batch_timeout_s=float(rng.randint(0, 3)),
        batch_wait_s=float(rng.randint(0, 2)),
        enable_prefix_caching=rng.random() < 0.7,
    )
    arrivals, aborts = [], {}
    for i in range(rng.randint(1, 12)):
        prompt_len = rng.randint(1, max_model_len - 1)
        shared = rng.randint(0, prompt_len) if rng.random() < 0.4 else 0
        prompt = [3 + (7 * j) % 50 for j in range(shared)]
        prompt += [3 + rng.randrange(90) for _ in range(prompt_len - shared)]
        fields = dict(
            request_id=f"r{i}",
            prompt_token_ids=prompt,
            max_tokens=rng.randint(1, 16),
            priority=rng.randint(0, 2),
        )
        step = rng.randint(0, 20)
        arrivals.append((step, fields))
        if rng.random() < 0.2:
            aborts[fields["request_id"]] = step + rng.randint(0, 10)
    return config, rng.random() < 0.5, arrivals, aborts


def plans_digest(
    scheduler_for: Callable[[dict, bool], object], update: Callable[[object, object, object], list]
) -> str:
    """The digest of every plan of every workload. ``scheduler_for(config, ahead)``
    makes a scheduler; ``update(sched, step, result)`` hands it a result and
    returns the outputs."""
    from iterserve.scheduler import FakeExecutor, Request, SamplingParams

    digest = hashlib.sha256()
    for seed in range(NUM_WORKLOADS):
        config, ahead, arrivals, aborts = workload(seed)
        sched = scheduler_for(config, ahead)
        executor = FakeExecutor(
            output_len=lambda rid: 1 + int(rid[1:]) % 7, block_size=config["block_size"]
        )
        pending = sorted(arrivals, key=lambda a: a[0])
        in_flight: deque = deque()
        clock = 0
        while pending or sched.has_work or in_flight:
            assert clock < 5000, f"workload {seed} made no progress"
            while pending and pending[0][0] <= clock:
                _, f = pending.pop(0)
                params = SamplingParams(max_tokens=f["max_tokens"], temperature=0.0)
                request = Request(f["request_id"], list(f["prompt_token_ids"]), params,
                                  arrival_time=float(clock), priority=f["priority"])  # fmt: skip
                sched.add_request(request)
            for request_id, at in aborts.items():
                if at == clock and request_id in sched.requests:
                    sched.abort(request_id)
            clock += 1
            for _ in range(2 if ahead else 1):
                if in_flight and not (ahead and sched.has_work):
                    break
                step = sched.schedule(float(clock))
                if step is None:
                    break
                digest.update(json.dumps(_plain(step.plan)[:PLAN_FIELDS]).encode())
                in_flight.append((step, executor.execute(step.plan)))
            if in_flight:
                update(sched, *in_flight.popleft())
        digest.update(f"end {seed} {clock}".encode())
    return digest.hexdigest()
