"""Scheduling ahead: while step N runs, ``schedule`` may build step N+1 (a
*lookahead* plan), so the workers start N+1 as soon as N ends instead of
waiting for the scheduler to take N's result and decide. What N will produce
is not known yet, so the lookahead plan is built on what is certain:

- every sequence N samples for is counted as one token longer (its token is
  *pending*); the workers hold that token and feed it to N+1 themselves;
- a sequence whose last token (``max_tokens``) N samples *retires*: its slot
  and blocks go to waiting requests in N+1, and it finishes when N's result
  brings that token;
- a sequence N ends by EOS or a stop token still gets a row in N+1, which the
  workers compute as padding (the cost of not knowing: one row, once);
- a plan that would have to preempt is not built ahead: ``schedule`` returns
  None and the caller schedules again once N's result is in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import Scheduler
    from .request import Request


def finishing_if_ahead_fits(sched: Scheduler) -> list[Request] | None:
    """The running sequences whose last token the step in flight samples; None
    unless every other one's next step, at its largest, fits in the free blocks
    (otherwise a choice in a plan built ahead could need a preemption)."""
    budget = sched.config.token_budget
    needed = 0
    finishing = []
    for request in sched.running.values():
        if request.finishes_in_flight:
            finishing.append(request)  # retires (or pads, in static batching)
            continue
        target = request.num_computed_tokens + min(request.num_remaining_tokens, budget)
        needed += sched.blocks.num_needed(request.request_id, target)
    return finishing if needed <= sched.blocks.num_free else None


def retire(sched: Scheduler, finishing: list[Request]) -> None:
    """Hands on the slot and blocks of every sequence whose last token the step
    in flight samples. The workers drop it when they sample that token, before
    they start the step being built, so the step may reuse both."""
    for request in finishing:
        # Its KV up to its last known token is computed by the step in flight.
        known = min(request.num_computed_tokens, request.num_tokens)
        sched.retiring[request.seq_id] = (request, sched.prefix.release(request, known))
        sched.release_slot(request, tell_workers=False)
        del sched.running[request.request_id]
        # The step in flight computes its last row with its adapter; a load that
        # reuses the slot travels in a later plan, applied after that step.
        sched.unpin_adapter(request)
