"""The iteration-level scheduling core. Pure Python: no ray, torch or triton.

Public surface:
- :class:`Request`, :class:`RequestStatus` — a request and its lifecycle.
- :class:`SamplingParams`, :class:`SamplingParamsError` — validated sampling knobs.
- :class:`SchedulerConfig` — frozen configuration of the scheduler.
- :class:`Scheduler` — ``schedule(now) -> ScheduledStep``, ``update(step, StepResult) -> outputs``.
- :mod:`~iterserve.scheduler.messages` — the two messages that cross to the workers.
- :mod:`~iterserve.scheduler.codec` — their strict msgpack codec.
- :class:`FakeExecutor` — a deterministic stand-in for the model workers;
  :class:`FakeModel` hands one to each rank of an engine (given in code).
"""

from iterserve.scheduler.config import POLICIES, SchedulerConfig
from iterserve.scheduler.core import Scheduler
from iterserve.scheduler.errors import PromptTooLongError, ProtocolError, QueueFullError
from iterserve.scheduler.fake_executor import FakeExecutor, FakeModel
from iterserve.scheduler.messages import StepPlan, StepResult
from iterserve.scheduler.request import FinishReason, Request, RequestOutput, RequestStatus
from iterserve.scheduler.sampling import SamplingParams, SamplingParamsError
from iterserve.scheduler.step import ScheduledStep, StepBuilder

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
