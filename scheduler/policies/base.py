"""The policy interface."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import SchedulerConfig
    from ..core import Scheduler
    from ..step import StepBuilder


class Policy:
    """Chooses what runs in each step, through the :class:`StepBuilder` of that
    step; between steps it sees the scheduler only to end a batch.

    ``holds_finished_slots``: a finished sequence keeps its slot (computed as
    padding) until the policy releases it — static batching's honest cost.
    """

    holds_finished_slots = False

    def __init__(self, config: SchedulerConfig):
        self.config = config

    def schedule(self, step: StepBuilder, now: float) -> None:
        raise NotImplementedError

    def after_update(self, sched: Scheduler) -> None:
        """Called at the end of every update (a batch may have ended)."""

    def reset(self, sched: Scheduler) -> None:
        """Forget batch state: every running sequence is about to be preempted."""

    def next_deadline(self, sched: Scheduler) -> float | None:
        """The time at which waiting work must launch even if nothing else happens."""
        return None
