"""The iteration-level scheduling core. Pure Python: no ray, torch or triton.

Public surface:
- :class:`Request`, :class:`RequestStatus` — a request and its lifecycle.
- :class:`SamplingParams`, :class:`SamplingParamsError` — validated sampling knobs.
- :class:`SchedulerConfig` — frozen configuration of the scheduler.
- :class:`Scheduler` — ``schedule(now) -> ScheduledStep``; ``update(StepResult) -> ScheduledStep``
  (the oldest step in flight, taken back, with its ``outputs``).
- :mod:`~iterserve.scheduler.messages` — the two messages that cross to the ranks.
- :mod:`~iterserve.scheduler.codec` — their strict msgpack codec.
- :class:`FakeExecutor` — a deterministic stand-in for the rank actors;
  :class:`FakeModel` hands one to each rank of an engine (given in code).
"""

from .config import POLICIES, SchedulerConfig
from .core import Scheduler
from .errors import PromptTooLongError, ProtocolError, QueueFullError
from .fake_executor import FakeExecutor, FakeModel
from .messages import StepPlan, StepResult
from .request import FinishReason, Request, RequestOutput, RequestStatus
from .sampling import SamplingParams, SamplingParamsError
from .step import ScheduledStep, StepBuilder

__all__ = [
    "POLICIES",
    "FakeExecutor",
    "FakeModel",
    "FinishReason",
    "PromptTooLongError",
    "ProtocolError",
    "QueueFullError",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "SamplingParamsError",
    "ScheduledStep",
    "Scheduler",
    "SchedulerConfig",
    "StepBuilder",
    "StepPlan",
    "StepResult",
]
