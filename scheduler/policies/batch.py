"""Request-level batching: the naive baselines.

Static batching collects up to ``max_num_seqs`` requests, prefills them all
padded to the longest prompt in one step, then decodes until *every* member
has finished. A member that finished early keeps its slot and is computed as a
padding token each step (the first-finisher problem), and no new request joins
until the whole batch is done. Dynamic batching is the same once launched; it
differs in *when* it launches: as soon as the batch is full or its oldest
request has waited ``batch_wait_s`` (late arrivals join until then), where
static waits up to ``batch_timeout_s`` for a full batch.

Admission reserves each member's worst case (prompt + max_tokens) in KV blocks,
so a launched batch never needs preemption.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..request import RequestStatus
from .base import Policy

if TYPE_CHECKING:
    from ..config import SchedulerConfig
    from ..queue import WaitingQueue
    from ..request import Request
    from ..step import StepBuilder


class StaticPolicy(Policy):
    holds_finished_slots = True

    def __init__(self, config: SchedulerConfig):
        super().__init__(config)
        self.batch: list[Request] = []

    def launch_wait_s(self) -> float:
        return self.config.batch_timeout_s

    def schedule(self, step: StepBuilder, now: float) -> None:
        if not self.batch:
            self._launch(step, now)
            return
        for member in self.batch:
            # A member whose last token the step in flight samples is padding from now.
            if member.status == RequestStatus.RUNNING and not member.finishes_in_flight:
                if not step.try_schedule(member, 1):  # cannot happen: worst case reserved
                    raise RuntimeError(f"{member.request_id}: reserved blocks ran out")
            elif member.slot_idx >= 0:  # finished, still batched
                step.pad_slot(member.slot_idx)

    def ended_batch(self) -> list[Request]:
        if self.batch and all(m.status.finished for m in self.batch):
            return self.reset()
        return []

    def reset(self) -> list[Request]:
        held = [m for m in self.batch if m.status.finished and m.slot_idx >= 0]
        self.batch = []
        return held

    def next_deadline(self, waiting: WaitingQueue) -> float | None:
        if self.batch:
            return None
        oldest = waiting.oldest_arrival()
        return None if oldest is None else oldest + self.launch_wait_s()

    def _ready(self, step: StepBuilder, now: float) -> bool:
        if len(step.waiting) >= self.config.max_num_seqs:
            return True
        oldest = step.waiting.oldest_arrival()
        return oldest is not None and now - oldest >= self.launch_wait_s()

    def _launch(self, step: StepBuilder, now: float) -> None:
        if not self._ready(step, now):
            return
        members: list[Request] = []
        longest = 0
        reserved = 0
        room = min(self.config.max_num_seqs, step.num_free_slots)
        for request in step.waiting.in_order():
            if len(members) >= room:
                break
            new_longest = max(longest, request.num_tokens)
            # Padded prefill: every member computes new_longest tokens.
            if new_longest * (len(members) + 1) > self.config.token_budget:
                break
            worst = step.blocks_needed(request, self._worst_tokens(request))
            if reserved + worst > step.num_free_blocks:
                break
            members.append(request)
            longest = new_longest
            reserved += worst
        for request in members:
            # Reserve the worst case now so decoding never runs out of blocks; one
            # whose blocks are not there after all waits for the next batch.
            pad = longest - request.num_tokens
            if step.try_schedule(request, request.num_tokens, pad, self._worst_tokens(request)):
                self.batch.append(request)

    @staticmethod
    def _worst_tokens(request: Request) -> int:
        return request.num_prompt_tokens + request.params.max_tokens


class DynamicPolicy(StaticPolicy):
    def launch_wait_s(self) -> float:
        return self.config.batch_wait_s
