"""The worker group: placement, start-up, and the per-step broadcast.

Each step's plan is encoded once and broadcast to every rank, and the replies
come back together, through the ``step_transport``:

- ``socket`` (the default): the step channel of :mod:`step_channel`, one stream
  socket per rank (Unix on the scheduler's node, TCP beyond it). Tens of
  microseconds, and nobody spins while waiting.
- ``compiled_graph``: one write into a Ray compiled graph over shared memory
  (~0.5 ms here). Its readers busy-wait: the scheduler and every rank keep a
  core each at 100%, idle or not, and across nodes its channels can drop a
  step's input and leave every rank waiting.
- ``actor_calls``: one plain actor call per rank per step (~1-6 ms here); for
  comparison.

A step is ``submit``-ted, then ``collect``-ed. The socket and the compiled graph
keep steps in order, so a second plan may be submitted before the first is
collected (``pipelines``): the scheduler builds the next step while this one
runs. Actor calls may overtake each other, so they run one step at a time.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from iterserve.cluster.config import EngineConfig
from iterserve.cluster.resources import rank_bundle
from iterserve.cluster.step_channel import TOKEN_BYTES, SchedulerChannel
from iterserve.cluster.worker import PING_STEP, EngineWorker
from iterserve.scheduler import codec
from iterserve.scheduler.messages import StepPlan, StepResult

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 300.0
# While a step runs longer than this, the graph's per-rank loops are checked: a rank
# killed mid-step fails the step within a second instead of at the step timeout (the
# compiled graph's reply channel does not always wake up when a rank dies).
LIVENESS_CHECK_S = 1.0


async def _resolve(futures):
    # One awaitable per rank (not asyncio futures); every output must be consumed.
    return [await future for future in futures]


async def _first_failure(futures):
    # One task or reference per rank: the first error ends the wait (a dead rank
    # must not wait behind a live one blocked in an all-reduce with it).
    return await asyncio.gather(*futures)


@dataclass
class Submitted:
    """A step handed to the ranks: what ``WorkerGroup.collect`` waits on."""

    step: int
    replies: asyncio.Future  # every rank's encoded reply, in rank order


class WorkerFailure(RuntimeError):
    """A worker died, hung past the step timeout, or raised during a step.
    ``generation`` names the started group that failed (see ``WorkerGroup.generation``)."""

    def __init__(self, message: str, generation: int = 0):
        super().__init__(message)
        self.generation = generation


class WorkerGroup:
    """The ranks of one engine. Inside a placement group laid out by
    :func:`~iterserve.cluster.resources.engine_bundles` (a Serve replica's), the
    ranks take bundles 1..tp;
    otherwise the group reserves a placement group of its own."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.workers: list = []
        self.pg = None
        self.owns_pg = True
        self.first_bundle = 0  # the bundle index of rank 0 in ``pg``
        self.dag = None
        self.num_kv_blocks = 0
        self.model_info: dict = {}
        self.generation = 0  # bumped by every start: a failure of an older group is stale
        self.transport = ""  # socket | compiled_graph | actor_calls, set by start()
        self.channel: SchedulerChannel | None = None  # the socket transport
        self.submitted: set[asyncio.Future] = set()  # replies not yet collected

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
        """Places the ranks, agrees on a KV cache size, loads, compiles the graph."""
        self.generation += 1
        tp = self.config.tensor_parallel_size
        if self.pg is None:
            await self._reserve()
        bundle = self.pg.bundle_specs[self.first_bundle]
        remote_cls = ray.remote(EngineWorker)
        self.workers = [
            remote_cls.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg,
                    placement_group_bundle_index=self.first_bundle + rank,
                ),
            ).remote(self.config, rank)
            for rank in range(tp)
        ]
        host, port = await self.workers[0].address.remote()
        await asyncio.gather(*(w.init_distributed.remote(host, port) for w in self.workers))
        self.model_info = await self.workers[0].model_info.remote()
        capacities = await asyncio.gather(*(w.kv_capacity.remote() for w in self.workers))
        self.num_kv_blocks = min(capacities)
        await asyncio.gather(*(w.load.remote(self.num_kv_blocks) for w in self.workers))
        self.transport = (
            "socket" if self.config.step_transport == "auto" else self.config.step_transport
        )
        if self.transport == "compiled_graph":
            with InputNode() as plan:
                outputs = MultiOutputNode([w.execute.bind(plan) for w in self.workers])
            self.dag = outputs.experimental_compile(enable_asyncio=True)
        elif self.transport == "socket":
            await self._open_channel()
        # The first execution sets up the channels; keep that out of the step timeout.
        await self.execute(StepPlan(step=PING_STEP), timeout_s=STARTUP_TIMEOUT_S)

    async def _open_channel(self) -> None:
        """Each rank listens (a Unix socket when it shares the scheduler's node, TCP
        otherwise) and takes the first connection presenting a fresh token."""
        token = secrets.token_bytes(TOKEN_BYTES)
        here = ray.get_runtime_context().get_node_id()
        placements = await self.placement()
        addresses = await asyncio.gather(*(
            w.open_step_channel.remote(token, p["NodeID"] == here)
            for w, p in zip(self.workers, placements, strict=True)
        ))  # fmt: skip
        self.channel = await SchedulerChannel.connect(list(addresses), token)

    async def _hand_over(self, data: bytes):
        """Hands the encoded plan to every rank; returns what awaits every reply."""
        if self.channel is not None:
            return _first_failure(await self.channel.send(data))
        if self.dag is not None:
            return _resolve(await self.dag.execute_async(data))
        return _first_failure([w.execute.remote(data) for w in self.workers])

    @property
    def pipelines(self) -> bool:
        """Whether a step may be submitted before the previous one is collected."""
        return self.transport in ("socket", "compiled_graph")

    async def execute(self, plan: StepPlan, timeout_s: float | None = None) -> StepResult:
        """One broadcast, one reply. Raises WorkerFailure on death, error or timeout."""
        return await self.collect(await self.submit(plan), timeout_s)

    async def submit(self, plan: StepPlan) -> Submitted:
        """Encodes ``plan`` once and hands it to every rank."""
        try:
            waiting = await self._hand_over(codec.encode(plan))
        except Exception as exc:  # a closed channel, a dead actor
            message = f"step {plan.step} failed: {type(exc).__name__}: {exc}"
            raise WorkerFailure(message, self.generation) from exc
        replies = asyncio.ensure_future(waiting)
        self.submitted.add(replies)
        return Submitted(plan.step, replies)

    async def collect(self, submitted: Submitted, timeout_s: float | None = None) -> StepResult:
        """The result of a submitted step, waiting up to the step timeout from now.
        Raises WorkerFailure on death, error or timeout."""
        timeout_s = timeout_s or self.config.step_timeout_s
        step = submitted.step
        try:
            replies = await self._replies(submitted.replies, timeout_s)
            # A reply that is not a valid result is the rank's fault: restart it.
            return codec.decode(replies[0], StepResult)
        except asyncio.TimeoutError:
            raise WorkerFailure(
                f"step {step} took longer than the step timeout of {timeout_s} s",
                self.generation,
            ) from None
        except WorkerFailure as exc:
            raise WorkerFailure(f"step {step} failed: {exc}", self.generation) from None
        except Exception as exc:  # actor death, channel errors, a worker's exception
            message = f"step {step} failed: {type(exc).__name__}: {exc}"
            raise WorkerFailure(message, self.generation) from exc
        finally:
            self.submitted.discard(submitted.replies)

    async def _replies(self, replies: asyncio.Future, timeout_s: float) -> list:
        """Every rank's reply; raises TimeoutError past ``timeout_s``, and WorkerFailure
        within about ``LIVENESS_CHECK_S`` of a rank's death."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise asyncio.TimeoutError
                done, _ = await asyncio.wait({replies}, timeout=min(LIVENESS_CHECK_S, remaining))
                if done:
                    return replies.result()
                if self._rank_loop_ended():
                    raise WorkerFailure("a rank died during the step", self.generation)
        finally:
            if not replies.done():
                replies.cancel()

    def _rank_loop_ended(self) -> bool:
        """Whether a rank's compiled-graph loop has ended, which it only does when the
        rank dies. A local check of references this process owns: no call reaches a
        rank (a hung rank is the step timeout's to catch). The other transports need
        no check: a dead rank's socket, or its failed actor call, ends the step."""
        if self.dag is None:
            return False
        loops = list(getattr(self.dag, "worker_task_refs", {}).values())
        if not loops:
            return False
        ended, _ = ray.wait(loops, num_returns=1, timeout=0, fetch_local=False)
        return bool(ended)

    async def ping(self) -> None:
        """Exercises every worker through the same path a step takes."""
        await self.execute(StepPlan(step=PING_STEP))

    async def placement(self) -> list[dict]:
        """Node id and pid of every rank, in rank order."""
        return list(await asyncio.gather(*(w.placement.remote() for w in self.workers)))

    async def pids(self) -> list[int]:
        return list(await asyncio.gather(*(w.pid.remote() for w in self.workers)))

    async def stop(self) -> None:
        """Kills the ranks (a hung or dead one included); the placement stays reserved."""
        dag, self.dag = self.dag, None
        for replies in self.submitted:  # steps lost with this group
            replies.cancel()
        self.submitted.clear()
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        if dag is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(dag.teardown), timeout=30)
            except Exception as exc:  # a torn channel may complain; the ranks are gone
                logger.warning("compiled graph teardown: %s", exc)

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def shutdown(self) -> None:
        await self.stop()
        if self.pg is not None and self.owns_pg:
            remove_placement_group(self.pg)
        self.pg = None
