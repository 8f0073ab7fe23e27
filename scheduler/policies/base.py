"""The policy interface."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from iterserve.scheduler.config import SchedulerConfig
    from iterserve.scheduler.core import Scheduler


class Policy:
    """Chooses what runs in each step.

    ``holds_finished_slots``: a finished sequence keeps its slot (computed as
    padding) until the policy releases it — static batching's honest cost.
    """

    holds_finished_slots = False

    def __init__(self, config: SchedulerConfig):
        self.config = config

    def schedule(self, sched: Scheduler, now: float) -> None:
        raise NotImplementedError

    def after_update(self, sched: Scheduler) -> None:
        """Called at the end of every update (a batch may have ended)."""

    def reset(self, sched: Scheduler) -> None:
        """Forget batch state: every running sequence is about to be preempted."""

    def next_deadline(self, sched: Scheduler) -> float | None:
        """The time at which waiting work must launch even if nothing else happens."""
        return None
