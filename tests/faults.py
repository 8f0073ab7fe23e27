"""Fault injection for tests: a stand-in model handed to engines in code, out of
reach of any deployment config (``AsyncEngine(config, executor=Faulty(...))``).

:class:`Faulty` is the fake model, with these faults besides its own options:

- ``fault_rank`` (default 0): the rank that faults;
- ``fault_crash_at_step``: that rank's process exits during this step;
- ``fault_hang_at_step``: that rank sleeps an hour in this step;
- ``fault_bad_result_at_step``: that rank answers this step with a result for the
  wrong step, which the scheduler takes for a protocol error (an engine bug);
- ``fault_once_file``: the fault fires only while this file does not exist, and
  creates it (so a replica that replaces a failed one runs clean).

Step numbers never repeat, so a restarted group does not fault again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iterserve.scheduler.fake_executor import FakeExecutor, FakeModel
from iterserve.scheduler.messages import StepPlan, StepResult


class FaultyExecutor:
    def __init__(self, inner: FakeExecutor, rank: int, faults: Faulty):
        self.inner = inner
        self.active = rank == faults.fault_rank
        self.faults = faults

    def _fires(self, key: str, step: int) -> bool:
        if not self.active or step != getattr(self.faults, key):
            return False
        once = self.faults.fault_once_file
        if once is None:
            return True
        try:
            Path(once).touch(exist_ok=False)
        except FileExistsError:
            return False
        return True

    def execute(self, plan: StepPlan) -> StepResult:
        if self._fires("fault_crash_at_step", plan.step):
            os._exit(1)
        if self._fires("fault_hang_at_step", plan.step):
            time.sleep(3600)
        result = self.inner.execute(plan)
        if self._fires("fault_bad_result_at_step", plan.step):
            result.step += 1000
        return result


@dataclass(frozen=True)
class Faulty(FakeModel):
    """The fake model, faulting as its ``fault_*`` fields say."""

    fault_rank: int = 0
    fault_crash_at_step: int | None = None
    fault_hang_at_step: int | None = None
    fault_bad_result_at_step: int | None = None
    fault_once_file: str | None = None

    def build(self, config: Any, rank: int, world_size: int, device: str, all_reduce: Any,
              runtime: dict | None = None):  # fmt: skip
        inner = super().build(config, rank, world_size, device, all_reduce, runtime)
        return FaultyExecutor(inner, rank, self)
