"""Iteration-level policies that fill one token budget per step.

Continuous batching recomposes the batch every step: finished sequences leave
at once and waiting ones take their slots. Chunked prefill additionally cuts
prompts into pieces, so a long prompt shares the step with the running decodes
instead of stalling them. Both follow the same order::

    budget = max_num_batched_tokens   (a small model on a CPU: decodes and short prompts
                                       share the device's 512 of it, see room_for)
    1. every running decode: 1 token          (preempting when blocks run out)
    2. running partial prefills: next piece   (chunked only)
    3. waiting prompts, in the order of service: whole (continuous) or a piece (chunked)

The order of service is the waiting queue's (``scheduling_policy``): priority
then arrival, arrival alone, or tenants in turn (``fair``, where a waiting
prompt of a less-served tenant also goes before a running prompt's next piece,
which then takes no more of the step than the newcomers did).
When blocks run out, the last running sequence in that order gives its blocks,
wherever it sits in the step; a step that preempted admits nobody.
A waiting prompt whose first blocks are cached (prefix caching) only needs
budget for the rest: ``step.num_to_compute`` says how much.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..request import Request
from .base import Policy

if TYPE_CHECKING:
    from ..step import StepBuilder


class ContinuousPolicy(Policy):
    chunked = False

    def piece(self, remaining: int, budget_left: int) -> int:
        """Tokens to compute now of a request with ``remaining`` tokens before its
        next sample; 0 means "not this step"."""
        return remaining if remaining <= budget_left else 0

    def schedule(self, step: StepBuilder, now: float) -> None:
        order = step.waiting  # the order of service (scheduling_policy)
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in step.running:
            (decodes if request.num_remaining_tokens == 1 else prefills).append(request)
        # A decode needs one new block at most: count them only when that may not fit.
        free = step.num_free_blocks
        if len(decodes) <= free or (
            sum(step.blocks_needed(r, r.num_computed_tokens + 1) for r in decodes) <= free
        ):
            # The common case: no decode can run out of blocks, so order does not matter.
            step.schedule_decodes(decodes)
            running = sorted(prefills, key=order.order_key)
        else:
            running = sorted(decodes, key=order.order_key) + sorted(prefills, key=order.order_key)
        num_admitted_partial = 0  # prompts admitted before running ones' pieces (fair)
        for request in running:
            if request.slot_idx < 0:  # preempted as a victim earlier in this loop
                continue
            remaining = request.num_remaining_tokens
            taken = 0  # budget that less-served tenants' prompts took before this piece
            if order.interleaves and remaining > 1 and not step.preempted:
                # Less-served tenants' waiting prompts go before this piece...
                partial = sum(1 for r in prefills if r.slot_idx >= 0) + num_admitted_partial
                num_entries = len(step.scheduled)
                num_admitted_partial += self._admit_waiting(step, partial, before=request) - partial
                # (not the budget's change: proposals dropped to make room give some back)
                taken = sum(e.num_tokens for e in step.scheduled[num_entries:])
            num_tokens = 1 if remaining == 1 else self.piece(remaining, step.room_for(remaining))
            if taken:
                # ...and it shrinks to what they took: the step that starts them stays
                # short, so their first tokens come sooner; the rest waits a step.
                num_tokens = min(num_tokens, taken)
            if num_tokens == 0:
                continue
            while not step.try_schedule(request, num_tokens):
                if step.drop_proposals():
                    continue  # proposals give their blocks back before anyone is preempted
                if step.new_seqs:
                    # Prompts admitted before it in this step (fair) took the blocks: it
                    # waits, as admission never preempts (nor may a plan built ahead).
                    break
                victim = step.victim()
                if victim is None:
                    break
                step.preempt(victim)
                if victim is request:
                    break
        if step.preempted:
            return  # memory is short: a new prompt now would be the next victim
        # Prompts part-way through prefill when the step began (and not preempted since).
        num_partial = sum(1 for r in prefills if r.slot_idx >= 0) + num_admitted_partial
        self._admit_waiting(step, num_partial)

    def _admit_waiting(
        self, step: StepBuilder, num_partial: int, before: Request | None = None
    ) -> int:
        """Admits waiting prompts in the order of service while the budget, the
        slots, the blocks and the cap on partial prefills allow (with ``before``:
        only those that go before that running prompt's next piece). Returns the
        prompts part-way through prefill then."""
        order = step.waiting
        while step.budget_left > 0 and step.num_free_slots > 0:
            request = order.peek()
            if request is None:
                break
            if not step.can_admit(request):
                # Its adapter waits for a slot, or its blocks for a disk read: one
                # that waits for neither goes first.
                request = order.first(step.can_admit)
                if request is None:
                    break
            if before is not None and not order.yields_to(request, before):
                break
            remaining = step.num_to_compute(request)
            num_tokens = self.piece(remaining, step.room_for(remaining))
            if num_tokens == 0:
                break
            partial = num_tokens < remaining
            if partial and num_partial >= self.config.max_num_partial_prefills:
                break
            # Admission never preempts: new work waits for free blocks (those of
            # this step's proposals included: they give way).
            if not step.try_schedule(request, num_tokens):
                if not (step.drop_proposals() and step.try_schedule(request, num_tokens)):
                    break
            num_partial += int(partial)
        return num_partial


class ChunkedPolicy(ContinuousPolicy):
    chunked = True

    def piece(self, remaining: int, budget_left: int) -> int:
        num_tokens = min(remaining, budget_left)
        threshold = self.config.long_prefill_token_threshold
        if threshold and remaining > threshold:
            num_tokens = min(num_tokens, threshold)
        return num_tokens
