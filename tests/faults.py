"""Fault injection for tests: an executor factory, never a product setting.

Engines under test name it as their executor (``executor="tests.faults:faulty"``);
its own options ride in ``executor_options`` next to the fake executor's:

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
from pathlib import Path

from iterserve.scheduler.fake_executor import FakeExecutor
from iterserve.scheduler.messages import StepPlan, StepResult

FAULT_OPTIONS = (
    "fault_rank", "fault_crash_at_step", "fault_hang_at_step", "fault_bad_result_at_step",
    "fault_once_file",
)  # fmt: skip


class FaultyExecutor:
    def __init__(self, inner: FakeExecutor, rank: int, options: dict):
        self.inner = inner
        self.active = rank == options.get("fault_rank", 0)
        self.options = options

    def _fires(self, key: str, step: int) -> bool:
        if not self.active or step != self.options.get(key):
            return False
        once = self.options.get("fault_once_file")
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


def faulty(config, rank: int, world_size: int, all_reduce) -> FaultyExecutor:
    """The fake executor of ``config``, faulting as its ``fault_*`` options say."""
    options = dict(config.executor_options)
    faults = {k: options.pop(k) for k in FAULT_OPTIONS if k in options}
    options.pop("max_model_len", None)
    inner = FakeExecutor(block_size=config.scheduler.block_size, **options)
    return FaultyExecutor(inner, rank, faults)
