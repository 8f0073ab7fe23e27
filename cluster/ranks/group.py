"""The rank group: placement, start-up, and the per-step broadcast.

Each step's plan is encoded once and written to every rank over the step
channel (:mod:`~iterserve.cluster.ranks.step_channel`: one stream socket per rank, Unix on the
scheduler's node, TCP beyond it). ``submit`` writes a plan; ``collect`` reads
the next reply of every rank. Ranks answer in order, so a second plan may be
submitted before the first is collected: the scheduler builds the next step
while this one runs. The group keeps no record of the steps in flight; the
engine does, and collects them oldest first.
"""

from __future__ import annotations

import asyncio
import logging

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ...scheduler import codec
from ...scheduler.messages import StepPlan, StepResult
from ..config import EngineConfig
from ..framing import new_token
from ..serve.resources import rank_bundle
from .actor import PING_STEP, RankActor
from .executors import ExecutorFactory
from .step_channel import SchedulerChannel

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 300.0


def merge_kv_reports(result: StepResult, other: StepResult) -> None:
    """Adds another rank's KV report to ``result``'s: each rank reports each of its
    disk reads once; the scheduler counts them."""
    if other.kv is None:
        return
    if result.kv is None:
        result.kv = other.kv
        return
    mine, theirs = result.kv, other.kv
    mine.reads_done += theirs.reads_done
    mine.reads_failed += theirs.reads_failed
    mine.writes_dropped += theirs.writes_dropped
    mine.copy_s = max(mine.copy_s, theirs.copy_s)
    mine.read_s += theirs.read_s
    mine.write_s += theirs.write_s


class RankFailure(RuntimeError):
    """A rank died, hung past the step timeout, or raised during a step.
    ``generation`` names the started group that failed (see ``RankGroup.generation``)."""

    def __init__(self, message: str, generation: int = 0):
        super().__init__(message)
        self.generation = generation


class RankGroup:
    """The ranks of one engine. Inside a placement group laid out by
    :func:`~iterserve.cluster.serve.resources.engine_bundles` (a Serve replica's), the
    ranks take bundles 1..tp; otherwise the group reserves a placement group of
    its own."""

    def __init__(self, config: EngineConfig, executors: ExecutorFactory | None = None):
        self.config = config
        self.executors = executors  # what each rank runs (None: the model)
        self.actors: list = []
        self.pg = None
        self.owns_pg = True
        self.first_bundle = 0  # the bundle index of rank 0 in ``pg``
        self.num_kv_blocks = 0
        self.model_info: dict = {}
        self.generation = 0  # bumped by every start: a failure of an older group is stale
        self.channel: SchedulerChannel | None = None
        self.links: list[str] = []  # how the step channel reaches each rank: unix | tcp
        self.kv_tiers: list[dict | None] = []  # each rank's KV tiers (kv_tier_info), if any

    async def _reserve(self) -> None:
        tp = self.config.tensor_parallel_size
        current = ray.util.get_current_placement_group()
        if current is not None and current.bundle_count == tp + 1:
            self.pg, self.owns_pg, self.first_bundle = current, False, 1
            return
        self.pg = placement_group(
            [rank_bundle(self.config)] * tp, strategy=self.config.placement_strategy
        )
        self.owns_pg, self.first_bundle = True, 0
        await self.pg.ready()

    async def start(self) -> None:
        """Places the ranks, agrees on a KV cache size, loads, opens the step channel."""
        self.generation += 1
        tp = self.config.tensor_parallel_size
        if self.pg is None:
            await self._reserve()
        bundle = self.pg.bundle_specs[self.first_bundle]
        remote_cls = ray.remote(RankActor)
        self.actors = [
            remote_cls.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg,
                    placement_group_bundle_index=self.first_bundle + rank,
                ),
            ).remote(self.config, rank, self.executors)
            for rank in range(tp)
        ]
        host, port = await self.actors[0].address.remote()
        await asyncio.gather(*(w.init_distributed.remote(host, port) for w in self.actors))
        # Every rank at the lowest instruction set among them, and what changes numerics
        # (the dtype, ...) decided once, by rank 0, and handed to all: ranks that decided
        # alone could compute one step differently and sample different tokens.
        levels = await asyncio.gather(*(w.cpu_isa.remote() for w in self.actors))
        self.model_info = await self.actors[0].model_info.remote(levels)
        runtime = self.model_info.get("runtime")
        capacities = await asyncio.gather(*(w.kv_capacity.remote(runtime) for w in self.actors))
        self.num_kv_blocks = min(capacities)
        self.kv_tiers = list(await asyncio.gather(
            *(w.load.remote(self.num_kv_blocks, runtime) for w in self.actors)
        ))  # fmt: skip
        await self._open_channel()
        # The first step sets up the connections; keep that out of the step timeout.
        await self.submit(StepPlan(step=PING_STEP))
        await self.collect(timeout_s=STARTUP_TIMEOUT_S)

    async def _open_channel(self) -> None:
        """Each rank listens (a Unix socket when it shares the scheduler's node, TCP
        otherwise) and takes the first connection presenting a fresh token."""
        token = new_token()
        here = ray.get_runtime_context().get_node_id()
        placements = await self.placement()
        addresses = await asyncio.gather(*(
            w.open_step_channel.remote(token, p["NodeID"] == here)
            for w, p in zip(self.actors, placements, strict=True)
        ))  # fmt: skip
        self.channel = await SchedulerChannel.connect(list(addresses), token)
        self.links = [address[0] for address in addresses]

    def _failure(self, what: str, exc: BaseException) -> RankFailure:
        return RankFailure(f"{what} failed: {type(exc).__name__}: {exc}", self.generation)

    async def submit(self, plan: StepPlan) -> None:
        """Encodes ``plan`` once and writes it to every rank."""
        try:
            await self.channel.send(codec.encode(plan))
        except Exception as exc:  # a closed channel: a rank died
            raise self._failure(f"step {plan.step}", exc) from exc

    async def collect(self, timeout_s: float | None = None) -> StepResult:
        """The result of the oldest step submitted and not yet collected, waiting up
        to the step timeout from now. Raises RankFailure on a rank's death (at once:
        its socket closes), error, malformed reply or timeout."""
        timeout_s = timeout_s or self.config.step_timeout_s
        try:
            replies = await asyncio.wait_for(self.channel.recv(), timeout_s)
            # A reply that is not a valid result is the rank's fault: restart it.
            result = codec.decode(replies[0], StepResult)
            for reply in replies[1:]:  # the other ranks answer only their KV tiers' reports
                if reply:
                    merge_kv_reports(result, codec.decode(reply, StepResult))
            return result
        except asyncio.TimeoutError:
            raise RankFailure(
                f"a step took longer than the step timeout of {timeout_s} s", self.generation
            ) from None
        except Exception as exc:  # a dead rank, a rank's exception, a bad reply
            raise self._failure("a step", exc) from exc

    async def ping(self) -> None:
        """Exercises every rank through the same path a step takes. Only with no
        step in flight: the ping's reply is the next one read."""
        await self.submit(StepPlan(step=PING_STEP))
        await self.collect()

    async def placement(self) -> list[dict]:
        """Node id and pid of every rank, in rank order."""
        return list(await asyncio.gather(*(w.placement.remote() for w in self.actors)))

    async def stop(self) -> None:
        """Kills the ranks (a hung or dead one included); the placement stays reserved.
        Closing the channel ends every step still in flight."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def shutdown(self) -> None:
        await self.stop()
        if self.pg is not None and self.owns_pg:
            remove_placement_group(self.pg)
        self.pg = None
