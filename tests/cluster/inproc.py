"""An engine in this process: a real EngineCore (scheduler, loop, intake, engine
channel, metrics) whose ranks are one executor run in the same event loop.

Steps still cross the codec both ways, and each takes a turn of the loop, so the
engine interleaves its steps with its clients' messages as it does with real
ranks. No Ray: an engine starts in milliseconds, so property tests can start one
per example.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from iterserve.cluster.config import EngineConfig
from iterserve.cluster.engine.connection import EngineConnection
from iterserve.cluster.engine.core import EngineCore
from iterserve.scheduler import FakeModel, codec
from iterserve.scheduler.messages import StepPlan, StepResult


class InProcessRanks:
    """What EngineCore needs of a RankGroup, with one executor in this process."""

    def __init__(self, config: EngineConfig, model: FakeModel):
        self.config = config
        self.model = model
        self.generation = 0
        self.links = ["in-process"]
        self.plans: deque[bytes] = deque()
        self.model_info: dict = {}
        self.num_kv_blocks = 0
        self.executor = None
        self.kv_tiers: list[dict | None] = []

    async def start(self) -> None:
        self.generation += 1
        self.model_info = {**self.model.model_info(self.config, "cpu"), "device": "cpu"}
        self.num_kv_blocks = self.config.scheduler.num_kv_blocks or 4096
        config = self.config.replace(num_kv_blocks=self.num_kv_blocks)
        self.executor = self.model.build(config, 0, 1, "cpu", None)
        info = getattr(self.executor, "kv_tier_info", None)
        self.kv_tiers = [info() if info is not None else None]

    async def submit(self, plan: StepPlan) -> None:
        self.plans.append(codec.encode(plan))

    async def collect(self, timeout_s: float | None = None) -> StepResult:
        await asyncio.sleep(0)  # a step takes a turn of the loop, as a rank's would
        plan = codec.decode(self.plans.popleft(), StepPlan)
        return codec.decode(codec.encode(self.executor.execute(plan)), StepResult)

    async def ping(self) -> None:
        await asyncio.sleep(0)

    async def placement(self) -> list[dict]:
        return []

    async def stop(self) -> None:
        self.plans.clear()

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def shutdown(self) -> None:
        await self.stop()


@contextlib.asynccontextmanager
async def engine_in_process(model: FakeModel, **config):
    """A started EngineCore of ``model`` and one client connected to it."""
    engine_config = EngineConfig.from_dict(config)
    core = EngineCore(engine_config, ranks=InProcessRanks(engine_config, model))
    info = await core.start()
    client = await EngineConnection.connect(info["endpoint"], "client", local=True)
    try:
        yield core, client
    finally:
        client.close()
        await core.shutdown()
