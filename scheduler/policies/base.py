"""The policy interface."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import SchedulerConfig
    from ..queue import WaitingQueue
    from ..request import Request
    from ..step import StepBuilder


class Policy:
    """Chooses what runs in each step, through the :class:`StepBuilder` of that
    step: it reads the scheduler and writes to it only there. Between steps it
    answers the scheduler's questions and changes nothing of it.

    ``holds_finished_slots``: a finished sequence keeps its slot (computed as
    padding) until the policy lets it go — static batching's honest cost.
    """

    holds_finished_slots = False

    def __init__(self, config: SchedulerConfig):
        self.config = config

    def schedule(self, step: StepBuilder, now: float) -> None:
        raise NotImplementedError

    def ended_batch(self) -> list[Request]:
        """Finished requests whose slots the policy held and lets go now (a batch
        that has wholly ended); the scheduler frees them. Asked after every update
        and before every step."""
        return []

    def reset(self) -> list[Request]:
        """Forgets batch state: every running sequence is about to be preempted.
        Returns the finished requests whose slots it held."""
        return []

    def next_deadline(self, waiting: WaitingQueue) -> float | None:
        """The time at which waiting work must launch even if nothing else happens."""
        return None
