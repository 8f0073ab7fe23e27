"""Iteration-level policies that fill one token budget per step.

Continuous batching recomposes the batch every step: finished sequences leave
at once and waiting ones take their slots. Chunked prefill additionally cuts
prompts into pieces, so a long prompt shares the step with the running decodes
instead of stalling them. Both follow the same order::

    budget = max_num_batched_tokens
    1. every running decode: 1 token          (preempting when blocks run out)
    2. running partial prefills: next piece   (chunked only)
    3. waiting prompts, priority then arrival: whole (continuous) or a piece (chunked)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iterserve.scheduler.policies.base import Policy
from iterserve.scheduler.request import Request

if TYPE_CHECKING:
    from iterserve.scheduler.core import Scheduler


class ContinuousPolicy(Policy):
    chunked = False

    def piece(self, request: Request, budget_left: int) -> int:
        """Tokens of ``request`` to compute now; 0 means "not this step"."""
        remaining = request.num_remaining_tokens
        return remaining if remaining <= budget_left else 0

    def schedule(self, sched: Scheduler, now: float) -> None:
        decodes, prefills = [], []
        for request in sched.running.values():
            (decodes if request.num_remaining_tokens == 1 else prefills).append(request)
        if self._decodes_fit(sched, decodes):
            # Common case: no decode can run out of blocks, so order does not matter.
            sched.schedule_decodes(decodes)
            running = sorted(prefills, key=Request.sort_key)
        else:
            running = sorted(decodes, key=Request.sort_key) + sorted(prefills, key=Request.sort_key)
        preempted = False
        for request in running:
            if request.slot_idx < 0:  # preempted as a victim earlier in this loop
                continue
            num_tokens = (
                1 if request.num_remaining_tokens == 1 else self.piece(request, sched.budget_left)
            )
            if num_tokens == 0:
                continue
            while not sched.try_schedule(request, num_tokens):
                # The worst running sequence gives its blocks, wherever it is in this
                # step's order (a decode scheduled earlier is taken out again).
                victim = max(sched.running.values(), key=Request.sort_key)
                sched.preempt(victim)
                preempted = True
                if victim is request:
                    break
        if preempted:
            return  # memory is short: a new prompt now would be the next victim
        # Prompts part-way through prefill when the step began (and not preempted since).
        num_partial = sum(1 for r in prefills if r.slot_idx >= 0)
        self._admit_waiting(sched, now, num_partial)

    @staticmethod
    def _decodes_fit(sched: Scheduler, decodes: list[Request]) -> bool:
        block_size = sched.config.block_size
        needed = 0
        for request in decodes:
            needed += request.needs_new_block(block_size)
        return needed <= sched.blocks.num_free

    def _admit_waiting(self, sched: Scheduler, now: float, num_partial: int) -> None:
        while sched.budget_left > 0 and sched.slots.num_free > 0:
            request = sched.waiting.peek()
            if request is None:
                return
            num_tokens = self.piece(request, sched.budget_left)
            if num_tokens == 0:
                return
            partial = num_tokens < request.num_remaining_tokens
            if partial and num_partial >= self.config.max_num_partial_prefills:
                return
            # Admission never preempts: new work waits for free blocks.
            if not sched.try_schedule(request, num_tokens):
                return
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            num_partial += partial


class ChunkedPolicy(ContinuousPolicy):
    chunked = True

    def piece(self, request: Request, budget_left: int) -> int:
        num_tokens = min(request.num_remaining_tokens, budget_left)
        threshold = self.config.long_prefill_token_threshold
        if threshold and request.num_remaining_tokens > threshold:
            num_tokens = min(num_tokens, threshold)
        return num_tokens
