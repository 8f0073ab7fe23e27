"""Batching policies behind one small interface.

A policy only *chooses*: in ``schedule(step, now)`` it calls
``step.try_schedule(request, num_tokens)`` (and ``step.pad_slot`` /
``step.preempt``) on the :class:`~iterserve.scheduler.step.StepBuilder` of that
one step until it is full. Everything else — slots, blocks, messages — belongs
to the :class:`~iterserve.scheduler.core.Scheduler`, which policies never see:
they import neither it nor anything that does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Policy
from .batch import DynamicPolicy, StaticPolicy
from .budget import ChunkedPolicy, ContinuousPolicy

if TYPE_CHECKING:
    from ..config import SchedulerConfig

POLICY_CLASSES: dict[str, type[Policy]] = {
    "static": StaticPolicy,
    "dynamic": DynamicPolicy,
    "continuous": ContinuousPolicy,
    "chunked": ChunkedPolicy,
}


def make_policy(config: SchedulerConfig) -> Policy:
    return POLICY_CLASSES[config.policy](config)


__all__ = ["POLICY_CLASSES", "Policy", "make_policy"]
