"""Drives a Scheduler with the FakeExecutor over a virtual clock, checking
invariants after every step. Shared by the property tests and benchmarks.

With ``ahead``, steps are driven as the engine drives them when it schedules
ahead: each iteration builds the next plan while the previous step is still in
flight, then takes that step's result."""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from iterserve.scheduler import (
    FakeExecutor,
    Request,
    RequestStatus,
    SamplingParams,
    ScheduledStep,
    Scheduler,
)
from iterserve.scheduler.codec import decode, encode
from iterserve.scheduler.messages import DEFAULT_TENANT, StepPlan, StepResult


@dataclass
class Arrival:
    request_id: str
    step: int
    prompt_len: int
    max_tokens: int
    output_len: int | None
    priority: int = 0
    abort_step: int | None = None
    abort_in_flight: bool = False
    # Names this arrival in the log; differs from request_id when a client reuses
    # the id of an earlier request (added once that one has left the scheduler).
    key: str = ""
    # The prompt's first ``prefix_len`` tokens are those of every arrival naming the
    # same ``prefix`` (a system prompt); the rest are its own.
    prefix: str = ""
    prefix_len: int = 0
    # The whole prompt, when given (a chat's next turn: an earlier prompt and its answer).
    prompt: list[int] | None = None
    tenant: str = DEFAULT_TENANT
    slo_steps: float | None = None  # its first token is due this many steps after arrival

    def __post_init__(self) -> None:
        self.key = self.key or self.request_id


@dataclass
class RunLog:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    preemptions: int = 0


def one_step(sched: Scheduler, executor: FakeExecutor, now: float = 0.0):
    """One step at a time: its plan (None when nothing runs), and its outputs."""
    scheduled = sched.schedule(now)
    if scheduled is None:
        return None, []
    return scheduled.plan, sched.update(executor.execute(scheduled.plan)).outputs


def released_ahead_ids(sched: Scheduler) -> set[str]:
    """Request ids whose last token the step in flight samples."""
    return {request.request_id for request, _ in sched.released_ahead.values()}


def prompt_for(request_id: str, n: int) -> list[int]:
    seed = zlib.crc32(request_id.encode())
    return [3 + (seed + 7 * i) % 97 for i in range(n)]


def arrival_prompt(a: Arrival) -> list[int]:
    if a.prompt is not None:
        return list(a.prompt)
    shared = min(a.prefix_len, a.prompt_len) if a.prefix else 0
    return prompt_for(f"prefix:{a.prefix}", shared) + prompt_for(a.key, a.prompt_len - shared)


class Checker:
    """Invariants that hold for every policy after every step."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.cfg = sched.config
        self.static_batch: set[int] = set()
        self.preemptions: dict[int, int] = {}

    def before(self) -> dict[str, bool]:
        self.preemptions = {r.seq_id: r.num_preemptions for r in self.sched.requests.values()}
        return {r.request_id: r.is_decoding for r in self.sched.running.values()}

    def check_preemption_order(self) -> None:
        """Whoever a step preempted is worse (priority, then arrival; arrival alone
        under fcfs) than every sequence still running. (Under fair, its tenant was
        the most served when it was chosen: the counters have moved since.)"""
        sched = self.sched
        if self.cfg.scheduling_policy == "fair":
            return
        key = sched.waiting.order_key
        victims = [
            r for r in sched.requests.values()
            if r.num_preemptions > self.preemptions.get(r.seq_id, r.num_preemptions)
        ]  # fmt: skip
        for victim in victims:
            for request in sched.running.values():
                assert key(request) < key(victim), (
                    f"{victim.request_id} {key(victim)} was preempted while "
                    f"{request.request_id} {key(request)} keeps running"
                )

    def after_schedule(self, plan: StepPlan, was_decoding: dict[str, bool]) -> None:
        cfg, sched = self.cfg, self.sched
        assert plan.num_tokens + plan.num_padding_tokens <= cfg.max_num_batched_tokens
        slots = [s.slot_idx for s in plan.scheduled] + plan.padding_slots
        assert len(slots) == len(set(slots)) <= cfg.max_num_seqs
        sched.check_integrity()
        self.check_preemption_order()
        if cfg.policy in ("continuous", "chunked"):
            # A finished sequence never keeps a slot.
            owners = {sched.slots.owner(i) for i in range(cfg.max_num_seqs)} - {None}
            assert owners <= set(sched.running), "a finished sequence holds a slot"
            # Every running decode is scheduled (or was preempted to make room).
            scheduled = {sched.slots.owner(s.slot_idx) for s in plan.scheduled}
            for request_id, decoding in was_decoding.items():
                request = sched.requests.get(request_id)
                if request_id in released_ahead_ids(sched):
                    continue  # its last token is being sampled by the step in flight
                if decoding and request is not None and request.status == RequestStatus.RUNNING:
                    assert request_id in scheduled, f"running decode {request_id} left out"
        else:
            new_ids = {n.seq_id for n in plan.new_seqs}
            if new_ids:
                # A batch launches only when the previous one has wholly ended.
                running = {r.seq_id for r in sched.running.values()}
                assert not (self.static_batch & running), "joined a running batch"
                self.static_batch = new_ids


def run(
    sched: Scheduler,
    executor: FakeExecutor,
    arrivals: list[Arrival],
    max_steps: int = 20_000,
    through_codec: bool = False,
    ahead: bool = False,
    on_plan: Callable[[StepPlan], None] | None = None,
) -> RunLog:
    """Runs ``arrivals`` to their end; ``on_plan`` sees each plan as it is handed over."""
    log = RunLog()
    # The results of the steps the executor has run and the scheduler has not yet
    # taken back: the executor runs each plan when it is handed over, in order,
    # like a rank.
    in_flight: deque[StepResult] = deque()
    pending = sorted(arrivals, key=lambda a: a.step)
    checker = Checker(sched)
    clock = 0
    by_step: dict[int, list[Arrival]] = {}
    for a in arrivals:
        if a.abort_step is not None:
            by_step.setdefault(a.abort_step, []).append(a)
    live: dict[str, str] = {}  # request_id -> key of the arrival now using it

    def abort(a: Arrival) -> None:
        if live.get(a.request_id) == a.key and sched.abort(a.request_id):
            log.reasons[a.key] = "abort"

    def hand_over(step: ScheduledStep, was_decoding: dict[str, bool]) -> None:
        plan = step.plan
        checker.after_schedule(plan, was_decoding)
        if on_plan is not None:
            on_plan(plan)
        for a in by_step.get(clock - 1, []):
            if a.abort_in_flight:
                abort(a)
        if through_codec:
            plan = decode(encode(plan), StepPlan)
        result = executor.execute(plan)
        if through_codec:
            result = decode(encode(result), StepResult)
        in_flight.append(result)

    while pending or sched.has_work or in_flight:
        assert clock < max_steps, "scheduler made no progress"
        while pending and pending[0].step <= clock:
            a = pending.pop(0)
            if a.request_id in sched.requests:  # its earlier user is still there
                a.step = clock + 1
                pending.insert(
                    next((i for i, p in enumerate(pending) if p.step > a.step), len(pending)), a
                )
                continue
            params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
            deadline = None if a.slo_steps is None else a.step + a.slo_steps
            sched.add_request(
                Request(
                    a.request_id,
                    arrival_prompt(a),
                    params,
                    arrival_time=float(a.step),
                    priority=a.priority,
                    tenant=a.tenant,
                    ttft_deadline=deadline,
                )
            )
            live[a.request_id] = a.key
            log.outputs[a.key] = []
        for a in by_step.get(clock, []):
            if not a.abort_in_flight:
                abort(a)
        clock += 1
        if not in_flight:
            was_decoding = checker.before()
            step = sched.schedule(float(clock - 1))
            if step is None:
                continue
            hand_over(step, was_decoding)
        if ahead and sched.has_work:
            was_decoding = checker.before()
            step = sched.schedule(float(clock - 1))
            if step is not None:
                assert step.plan.ahead
                hand_over(step, was_decoding)
        for out in sched.update(in_flight.popleft()).outputs:
            key = live[out.request_id]
            log.outputs[key].extend(out.new_token_ids)
            if out.finished:
                log.reasons[key] = out.finish_reason.value
        sched.check_integrity()
        log.steps += 1
    log.preemptions = sched.num_preemptions
    return log
