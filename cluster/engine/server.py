"""One data-parallel engine copy as a Serve deployment: a scheduler actor.

Each ``EngineServer`` replica runs an ``EngineCore`` on its own event loop and
owns that core's rank actors. Serve starts, places, health-checks and
replaces the replicas; requests and their tokens reach a replica over the
engine channels its ingresses open (:mod:`~iterserve.cluster.engine.channel`), never through
Serve's request path.

A replica that stops (Serve scales it down, a redeploy replaces it, the server
shuts down) drains first (:meth:`EngineCore.drain`): every ingress hears at
once that it takes nothing new, and its requests run on for up to the config's
``drain_timeout_s``. Serve's own wait for a stopping replica counts only the
requests that come through its handles, none of ours, so the drain happens in
the replica's destructor, which Serve gives ``drain_timeout_s`` and a margin.
The same replica reports its load to Serve's autoscaler
(:meth:`EngineServer.record_autoscaling_stats`,
:mod:`~iterserve.cluster.serve.autoscaling`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import ray
from ray import serve

from ..config import EngineConfig
from ..ranks.executors import ExecutorFactory
from ..serve import resources
from .core import EngineCore

logger = logging.getLogger(__name__)


def _replica_name() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (direct construction in tests)
        return uuid.uuid4().hex[:8]


def _replica_rank() -> int:
    """This replica's index among the engine copies: the ``engine`` metric label."""
    try:
        rank = serve.get_replica_context().rank
        return int(getattr(rank, "rank", rank))
    except Exception:  # outside a Serve replica, or a Serve without ranks
        return 0


@serve.deployment(
    ray_actor_options={"num_cpus": resources.SCHEDULER_CPUS}, health_check_period_s=10
)
class EngineServer:
    """One data-parallel engine copy: an ``EngineCore`` running in this replica."""

    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        metrics_hub: str,
        executor: ExecutorFactory | None = None,
    ):
        self.drain_timeout_s = config.drain_timeout_s
        self.core = EngineCore(
            config,
            model_name=model_name,
            engine_index=_replica_rank(),
            metrics_hub=metrics_hub,
            executor=executor,
        )
        self.replica = _replica_name()
        # Start-up (rank placement, model load) runs in the background so the
        # replica answers health checks while loading; every call awaits it.
        self.started = asyncio.get_running_loop().create_task(self._start())

    async def _start(self) -> dict:
        return await self.core.start()

    async def _ready(self) -> dict:
        return await asyncio.shield(self.started)

    def endpoint(self) -> dict | None:
        """Where ingresses connect (and the token they present), once the engine is
        up; ``{"replica", "loading": True}`` while it loads (an ingress with no
        other replica waits for it); None when it failed to start or is stopping."""
        if not self.started.done():
            return {"replica": self.replica, "loading": True}
        if self.started.exception() is not None or self.core.draining:
            return None
        return {**self.started.result()["endpoint"], "replica": self.replica}

    async def info(self) -> dict:
        info = dict(await self._ready())
        del info["endpoint"]  # each ingress asks for it by itself (endpoint)
        return {**info, "replica": self.replica}

    def _start_failure(self) -> str | None:
        if self.started.done() and self.started.exception() is not None:
            return f"the engine failed to start: {self.started.exception()}"
        return None

    async def stats(self) -> dict:
        """The scheduler's stats; a replica still loading (or failed) answers at once."""
        failure = self._start_failure()
        if failure or not self.started.done():
            status = {"replica": self.replica, "ready": False, "counters": {}}
            return {**status, "healthy": failure is None, "message": failure or "starting"}
        stats = {**await self.core.stats(), **self.core.control.state()}
        return {**stats, "replica": self.replica, "ready": True}

    async def health(self) -> dict:
        """``{"healthy", "ready", "message", "replica"}``. A replica still loading its
        model is healthy (Serve must not replace it) but not ready."""
        status = {"healthy": True, "ready": False, "message": "starting", "replica": self.replica}
        if self._start_failure():
            status.update(healthy=False, message=self._start_failure())
        elif self.started.done():
            healthy, message = await self.core.health()
            status.update(healthy=healthy, ready=healthy, message=message)
        return status

    async def load_lora_adapter(self, name, path, base_model_name=None) -> tuple | None:
        """``None``, or the refusal ``(kind, message)`` (cluster/lora.py)."""
        await self._ready()
        return await self.core.load_lora_adapter(name, path, base_model_name)

    async def unload_lora_adapter(self, name) -> tuple | None:
        await self._ready()
        return await self.core.unload_lora_adapter(name)

    async def lora_adapters(self) -> list[dict]:
        await self._ready()
        return await self.core.lora_adapters()

    # -- the operator's: pause, resume, sleep, wake (cluster/engine/pause.py) -------------

    async def pause(self, mode: str) -> dict:
        """``{"paused", "sleeping", "sleep_level", "mode", "aborted"}``; raises
        ValueError for a mode it does not know."""
        await self._ready()
        return {**await self.core.control.pause(mode), "replica": self.replica}

    async def resume(self) -> dict:
        """Raises EngineStateError while asleep."""
        await self._ready()
        return {**await self.core.control.resume(), "replica": self.replica}

    async def sleep(self, level: int, mode: str) -> dict:
        await self._ready()
        return {**await self.core.control.sleep(level, mode), "replica": self.replica}

    async def wake_up(self) -> dict:
        await self._ready()
        return {**await self.core.control.wake_up(), "replica": self.replica}

    async def reset_prefix_cache(self, reset_external: bool, reset_running: bool) -> dict:
        """``{"success"}``: whether this replica forgot every cached block."""
        await self._ready()
        done = await self.core.reset_prefix_cache(reset_external, reset_running)
        return {"success": done, "replica": self.replica}

    async def operator_state(self) -> dict:
        """``{"paused", "sleeping", "sleep_level"}`` (a replica still loading: neither)."""
        if not self.started.done():
            return {
                "paused": False,
                "sleeping": False,
                "sleep_level": None,
                "replica": self.replica,
            }
        return {**self.core.control.state(), "replica": self.replica}

    async def placement(self) -> dict:
        """Where this replica and its ranks run: node, placement group and process ids."""
        await self._ready()
        context = ray.get_runtime_context()
        return {
            "NodeID": context.get_node_id(),
            "placement_group": context.get_placement_group_id(),
            "workers": await self.core.worker_nodes(),
        }

    async def check_health(self) -> None:
        """Serve's health check: raising makes Serve replace this replica."""
        status = await self.health()
        if not status["healthy"]:
            raise RuntimeError(status["message"])

    async def drain(self) -> dict:
        """Stops taking requests and waits until those it has end (at most
        ``drain_timeout_s``); see :meth:`EngineCore.drain`. The replica keeps
        answering health checks and stats meanwhile."""
        if not self.started.done() or self.started.exception() is not None:
            self.core.draining = True
            return {"finished": 0, "cut": 0}
        return await self.core.drain(self.drain_timeout_s)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """This replica's load, as Serve's autoscaling policy reads it."""
        return self.core.autoscaling_stats()

    async def __del__(self) -> None:
        if self.started.done() and self.started.exception() is None:
            try:
                drained = await self.core.drain(self.drain_timeout_s)
                logger.info("engine replica %s drained: %s", self.replica, drained)
            except Exception:
                logger.exception("draining engine replica %s failed", self.replica)
            await self.core.shutdown()
        else:
            self.started.cancel()
