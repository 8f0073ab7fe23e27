"""The scheduler actor: owns the iteration clock, the slot table and the ranks.

Its loop is one tick after another. The steps handed to the ranks and not yet
taken back are one queue, the scheduler's own: it holds at most two (the one
running and the one built ahead of it) with ``async_scheduling``, else one;
``schedule`` builds nothing while it is full, and ``update`` pairs each result
with the oldest::

    tick():
        submit(scheduler.schedule(now))             # when the queue has room
        submit(scheduler.schedule(now))             # built ahead, while the one before runs
        outputs = scheduler.update(await collect()).outputs   # tokens, finishes, freed KV
        publish(outputs)

With two in flight the ranks start step N+1 the moment N ends, and the
scheduler's own work for a step (update, publish, schedule, encode) overlaps
the next step's forward. It sleeps while there is no work and wakes on arrival,
and parks while an operator has paused it (:mod:`~iterserve.cluster.engine.pause`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from pathlib import Path

import ray

from ...scheduler import (
    FinishReason,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    SamplingParamsError,
    Scheduler,
)
from ...scheduler.adapters import AdapterNotFoundError
from ...scheduler.messages import EngineOutput, EngineRequest
from ..config import EngineConfig
from ..gc_pauses import freeze_startup_objects
from ..lora import EngineAdapters
from ..metrics.engine import EngineMetrics
from ..metrics.recorder import MetricsRecorder
from ..ranks.executors import ExecutorFactory
from ..ranks.group import RankFailure, RankGroup
from . import RUNTIME_KEYS
from .channel import DEAD, DRAINING, SERVING, EngineEndpoint
from .errors import (
    ContextLengthError,
    EngineBusyError,
    EngineDeadError,
    EngineDrainingError,
    InvalidRequestError,
    ModelNotFoundError,
)
from .intake import checked_request
from .kv_tiers import EngineKVTiers
from .outputs import OutputBuffers
from .pause import PauseControl

logger = logging.getLogger(__name__)
# A scrape sees the engines at most this stale; each push is a snapshot of every
# family through Ray, which at once a second cost the engine a few percent of its CPU.
METRICS_PUSH_INTERVAL_S = 5.0
DRAIN_POLL_S = 0.05  # how often a draining engine looks whether its last request ended
FLUSH_TIMEOUT_S = 5.0  # what a drained engine waits for its clients to take their last outputs


class RestartBudget:
    """At most ``max_restarts`` rank-group restarts within any ``window_s``
    seconds: failures spread over a long life never add up to the end of the
    engine, a crash loop does."""

    def __init__(self, max_restarts: int, window_s: float, clock=time.monotonic):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self.times: deque[float] = deque()

    def take(self) -> bool:
        """Records a restart and returns True, or False when the window's are spent."""
        now = self.clock()
        while self.times and now - self.times[0] >= self.window_s:
            self.times.popleft()
        if len(self.times) >= self.max_restarts:
            return False
        self.times.append(now)
        return True


class EngineCore:
    """``model_name`` and ``engine_index`` label this engine's metrics; with
    ``metrics_hub`` set, the metrics are pushed to that hub actor for the ingress.
    ``executor`` builds what its ranks run (:mod:`~iterserve.cluster.ranks.executors`; None: the model);
    ``ranks`` stands in for the ranks themselves (tests run an engine in one
    process so), else they are Ray actors (:class:`RankGroup`)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        model_name: str | None = None,
        engine_index: int = 0,
        metrics_hub: str | None = None,
        executor: ExecutorFactory | None = None,
        ranks: RankGroup | None = None,
    ):
        self.config = config
        self.metrics = EngineMetrics(
            model_name or Path(config.model_path).name,
            engine_index,
            config.scheduler.policy,
            ray_metrics=config.ray_metrics and ray.is_initialized(),
        )
        self.recorder = MetricsRecorder(self.metrics)
        self.metrics_hub = metrics_hub
        self.engine_key = f"{self.metrics.model_name}/{engine_index}"
        self.push_task: asyncio.Task | None = None
        self.ranks = ranks or RankGroup(config, executor)
        self.runs_model = executor is None  # a stand-in executor has no weights to check
        self.scheduler: Scheduler | None = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.outputs = OutputBuffers()
        self.endpoint: EngineEndpoint | None = None  # where clients connect, once started
        self.wake = asyncio.Event()
        self.loop_task: asyncio.Task | None = None
        self.step_lock = asyncio.Lock()
        self.last_result_at = 0.0
        self.dead_reason: str | None = None
        self.draining = False  # stopping: finishing what it has, taking nothing new
        self.num_restarts = 0
        self.restarts = RestartBudget(config.max_restarts, config.restart_window_s)
        self.control = PauseControl(self)  # pause, resume, sleep, wake (the operator's)
        self.kv = EngineKVTiers(config, engine_index, self.metrics)  # host, disk, events

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> dict:
        try:
            await self.ranks.start()
        except BaseException:
            # A start that fails (a checkpoint the loader refuses, no room to place the
            # ranks) must not keep ranks or their reservation for nobody.
            await self.ranks.shutdown()
            raise
        info = self.ranks.model_info
        self.max_model_len = self.config.scheduler.context_for(info["max_model_len"])
        self.vocab_size = info["vocab_size"]
        device, step_tokens = info["device"], info.get("step_tokens")
        self.scheduler = Scheduler(
            self.config.scheduler.resolved(
                num_kv_blocks=self.ranks.num_kv_blocks,
                max_model_len=self.max_model_len,
                device=device,
                step_tokens=step_tokens,
            ),
            short_budget=self.config.scheduler.short_budget(
                device, self.max_model_len, step_tokens
            ),
            ahead=self.config.async_scheduling,
            kv_window=info.get("kv_window"),
            tiers=self.kv.tier_config(self.ranks.kv_tiers),
        )
        self.kv.started(self.scheduler, self.ranks.kv_tiers)
        self.adapters = EngineAdapters(
            self.config, self.scheduler, self.metrics.model_name, check_weights=self.runs_model
        )
        self.adapters.load_configured()
        self.recorder.state(self.scheduler)
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.endpoint = EngineEndpoint(self, host)
        address = await self.endpoint.start()
        freeze_startup_objects()
        loop = asyncio.get_running_loop()
        self.loop_task = loop.create_task(self._loop())
        if self.metrics_hub:
            from ..metrics.hub import push_periodically

            self.push_task = loop.create_task(
                push_periodically(self.metrics, self.engine_key, hub_name=self.metrics_hub,
                                  interval_s=METRICS_PUSH_INTERVAL_S)
            )  # fmt: skip
        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        return {
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "num_kv_blocks": self.ranks.num_kv_blocks,
            "endpoint": {**address, "node_id": node_id},
            # What the ranks compute in and why ("auto" is decided on their device), on
            # which instruction set, with which kernels, and the length of a pooling
            # runner's vectors.
            **{k: info[k] for k in RUNTIME_KEYS + ("hidden_size",) if k in info},
        }

    @property
    def state(self) -> tuple[str, str]:
        """``(state, message)``: ``serving``, ``draining`` or ``dead``, as the
        engine channel's ``NOTICE`` tells clients."""
        if self.dead_reason is not None:
            return DEAD, self.dead_reason
        if self.draining:
            return DRAINING, "the engine replica is stopping"
        return SERVING, ""

    async def drain(self, timeout_s: float) -> dict:
        """Stops taking requests and tells every client so at once, lets the ones
        it has run to their end for up to ``timeout_s``, then ends those still
        running with an error that says the drain ran out (each client gets its
        requests' last outputs before this returns). Returns how many requests
        ``finished`` and how many were ``cut`` at the deadline."""
        if not self.draining:
            self.draining = True
            if self.endpoint is not None and self.dead_reason is None:
                self.endpoint.notify(*self.state)
        if self.scheduler is None:  # never started
            return {"finished": 0, "cut": 0}
        at_start = len(self.scheduler.requests)
        deadline = time.monotonic() + timeout_s
        while self.scheduler.requests and self.dead_reason is None:
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        cut = 0
        if self.scheduler.requests and self.dead_reason is None:
            async with self.step_lock:
                with contextlib.suppress(RankFailure):
                    await self._drain()  # the steps in flight: their tokens still go out
                cut = len(self.scheduler.requests)
                self._end_all(
                    f"the engine replica is stopping and its drain_timeout_s ({timeout_s:g} s) "
                    "ran out before this request finished; retry it"
                )
        self.outputs.flush()
        if self.endpoint is not None:
            await self.endpoint.flush(FLUSH_TIMEOUT_S)
        return {"finished": max(0, at_start - cut), "cut": cut}

    async def shutdown(self) -> None:
        for task in (self.loop_task, self.push_task):
            if task is not None:
                task.cancel()
        self.kv.close()
        if self.endpoint is not None:
            self.endpoint.close()
        await self.ranks.shutdown()

    # -- the loop ---------------------------------------------------------------------

    async def _loop(self) -> None:
        try:
            while self.dead_reason is None:
                if self.control.paused:
                    await self.control.park()
                    continue
                if not self.scheduler.has_work and not self.scheduler.num_in_flight:
                    # The allocators check themselves each time the engine goes idle:
                    # every slot and block free again, no request lost. A failure is a
                    # bug, and ends the engine as any other.
                    self.scheduler.check_integrity()
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                try:
                    ran = await self.tick()
                except RankFailure as exc:
                    await self._recover(exc)
                    continue
                if not ran:  # waiting for a batch to fill (static, dynamic)
                    await self._sleep_until(self.scheduler.next_deadline())
        except Exception as exc:  # a bug: the scheduler's state can no longer be trusted
            await self._engine_failed(exc)

    async def tick(self) -> bool:
        """One iteration (see the module docstring). False when nothing ran."""
        async with self.step_lock:
            await self._submit_next()
            if not self.scheduler.num_in_flight:
                return False
            if self.scheduler.has_work:
                await self._submit_next()  # built ahead, while the one before runs
            outputs = await self._collect()
        self.publish(outputs)
        return True

    async def _submit_next(self) -> None:
        step = self.scheduler.schedule(time.monotonic())  # None: the queue is full, or no work
        if step is not None:
            await self.ranks.submit(step.plan)

    async def _collect(self) -> list[RequestOutput]:
        result = await self.ranks.collect()
        self.kv.observe(result.kv)
        step = self.scheduler.update(result)  # the oldest step in flight, taken back
        self.kv.after_step(self.scheduler)  # the tiers' events and metrics
        now = time.monotonic()
        # The step's time on the critical path: from the previous result when it was
        # built ahead, else from the start of its scheduling.
        step_s = now - max(step.scheduled_at, self.last_result_at)
        self.last_result_at = now
        self.recorder.step(step, result, step_s, self.scheduler)
        return step.outputs

    async def _drain(self) -> None:
        """Collects every step in flight (under ``step_lock``), so that nothing runs
        behind a health check or an integrity check. A result that breaks the
        scheduler here ends the engine as it would in the loop."""
        while self.scheduler.num_in_flight:
            try:
                outputs = await self._collect()
            except RankFailure:
                raise
            except Exception as exc:
                await self._engine_failed(exc)
                return
            self.publish(outputs)

    async def _engine_failed(self, exc: BaseException) -> None:
        logger.error("the engine failed", exc_info=exc)
        await self._stop_serving(f"the engine failed: {type(exc).__name__}: {exc}")

    async def _sleep_until(self, deadline: float | None) -> None:
        self.wake.clear()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout)

    async def _recover(self, exc: RankFailure) -> None:
        """Preempts every running sequence for recompute and restarts the ranks;
        once restarts are exhausted, every in-flight request ends with an error."""
        logger.error("rank failure: %s", exc)
        async with self.step_lock:
            if exc.generation != self.ranks.generation:
                return  # a failure of a group already replaced (a step and a ping both saw it)
            self.scheduler.requeue_running()  # the steps in flight were lost with the ranks
            if not self.restarts.take():
                window = self.config.restart_window_s
                self._fail_all(
                    f"the engine's ranks failed and could not be restarted "
                    f"({self.config.max_restarts} restarts within {window:g} s): {exc}"
                )
                await self.ranks.stop()
                return
            self.num_restarts += 1
            self.recorder.rank_restart()
            try:
                await self.ranks.restart()
                self.kv.ranks_ready(self.scheduler, self.ranks.kv_tiers)
            except Exception as restart_exc:  # any start-up failure ends service
                self._fail_all(f"restarting the engine's ranks failed: {restart_exc}")
            self.kv.after_step(self.scheduler)

    async def _stop_serving(self, message: str) -> None:
        """Fails every request at once and reports unhealthy from now on, so that
        nobody waits on an engine that no longer steps; under Serve the health
        check then replaces this replica."""
        self.scheduler.drop_in_flight()  # nothing will collect them
        self._fail_all(message)
        try:
            await self.ranks.stop()
        except Exception:  # the ranks may be the broken part; they are gone either way
            logger.exception("stopping the ranks failed")

    def _fail_all(self, message: str) -> None:
        """Ends every request with an error and the engine with them: from now on
        it refuses every request, and every client is told at once (``dead``).
        The first reason is the one the engine keeps reporting."""
        if self.dead_reason is None:
            self.dead_reason = message
            if self.endpoint is not None:
                self.endpoint.notify(*self.state)
        self._end_all(message)

    def _end_all(self, message: str) -> None:
        """Ends every request with an error, each ended in the scheduler and its
        failure sent on its own: a scheduler whose state is broken cannot keep the
        others from ending."""
        for request in list(self.scheduler.requests.values()):
            try:
                self.scheduler.finish_with_error(request.request_id)
            except Exception:
                logger.exception("%s: ending it in the scheduler failed", request.request_id)
            self.outputs.push(request.client, EngineOutput.failed(request.request_id, message))
            self.recorder.finished(request, FinishReason.ERROR)
        with contextlib.suppress(Exception):
            self.recorder.state(self.scheduler)

    # -- requests and their outputs --------------------------------------------------

    def publish(self, outputs: list[RequestOutput]) -> None:
        self.recorder.outputs(outputs)
        push = self.outputs.push
        for out in outputs:
            push(
                out.request.client,
                EngineOutput(
                    out.request_id,
                    out.new_token_ids,
                    out.new_logprobs,
                    out.prompt_logprobs,
                    out.finish_reason.value if out.finish_reason else None,
                    None,
                    out.num_cached_tokens,
                    out.pooled,
                ),
            )

    async def add_request(self, client: str, wire: EngineRequest) -> tuple[str, str] | None:
        """Queues a request. Returns None, or ``(kind, message)`` when refused, the
        kind of a refusal class of :mod:`~iterserve.cluster.engine.errors`.

        ``wire.request_id`` must be unique among the engine's requests: clients make
        it so themselves (never from what a user sends). ``wire.label`` is the
        user's own name for the request, for logs; it may repeat."""
        if self.dead_reason is not None:
            return (EngineDeadError.kind, self.dead_reason)
        if self.draining:
            return (EngineDrainingError.kind, self.state[1])
        try:
            request = checked_request(
                wire, limits=self.config.scheduler, vocab_size=self.vocab_size
            )
            request.client = client
            if self.control.holding:  # a wait-mode pause: it queues once the engine is empty
                return self.control.hold(request)
            self.scheduler.add_request(request)
        except QueueFullError as exc:
            self.recorder.rejected("queue_full")
            return (EngineBusyError.kind, str(exc))
        except PromptTooLongError as exc:
            return (ContextLengthError.kind, str(exc))
        except AdapterNotFoundError as exc:
            return (ModelNotFoundError.kind, f"The model '{exc.args[0]}' does not exist")
        except (SamplingParamsError, ValueError, TypeError) as exc:
            return (InvalidRequestError.kind, str(exc))
        self.recorder.admitted(request)
        self.wake.set()
        return None

    async def abort(self, request_id: str) -> bool:
        if self.dead_reason is not None:
            return False  # every request has ended already
        out = self.scheduler.abort(request_id)
        if out is None:
            return False
        self.recorder.finished(out.request, FinishReason.ABORT)
        self.outputs.push(out.request.client, EngineOutput.aborted(request_id))
        return True

    def requests_of(self, client: str) -> list[str]:
        """The requests ``client`` added that have not ended."""
        return [r.request_id for r in self.scheduler.requests.values() if r.client == client]

    async def reset_prefix_cache(
        self, reset_external: bool = False, reset_running: bool = False
    ) -> bool:
        """Forgets every cached block (``reset_external``: the host and disk tiers'
        too) once the steps in flight are taken back; False while requests hold
        blocks (vLLM's answer: retry), unless ``reset_running`` preempts them first."""
        if self.dead_reason is not None:
            return False
        async with self.step_lock:
            await self._drain()
            done = self.scheduler.reset_prefix_cache(reset_external, reset_running)
        self.kv.after_step(self.scheduler)
        self.wake.set()  # the disk's clear goes with the next step
        return done

    # -- LoRA adapters (cluster/lora.py) -------------------------------------------------

    async def load_lora_adapter(self, name, path, base_model_name=None) -> tuple | None:
        return self.adapters.load(name, path, base_model_name)

    async def unload_lora_adapter(self, name) -> tuple | None:
        return self.adapters.unload(name)

    async def lora_adapters(self) -> list[dict]:
        return self.adapters.listing()

    # -- introspection ----------------------------------------------------------------------

    async def stats(self) -> dict:
        """The scheduler's state and the engine's totals (the same numbers as its
        metrics: one record of every event)."""
        return {
            **self.scheduler.stats(),
            **self.metrics.totals(),
            "healthy": self.dead_reason is None,
            "state": self.state[0],
            "rank_restarts": self.num_restarts,
            "rank_links": self.ranks.links,
            "max_model_len": self.max_model_len,
            **self.adapters.stats(),
            **self.kv.stats(self.scheduler),
            "tenants": self._tenant_stats(),
        }

    def _tenant_stats(self) -> dict[str, dict]:
        """Per tenant: requests waiting and running now (and under ``fair`` its counter,
        ``served``), tokens computed for it and first tokens past their target."""
        tenants = self.scheduler.tenant_stats()
        zero = {"waiting": 0, "running": 0}
        for name, totals in self.recorder.tenants.stats().items():
            tenants[name] = {**tenants.get(name, zero), **totals}
        return tenants

    def autoscaling_stats(self, window_s: float = 10.0) -> dict[str, float]:
        """The load signals Serve's autoscaler reads (``record_autoscaling_stats``):
        requests waiting and running, the share of KV blocks in use, and the time
        to first token: the mean of the last ``window_s`` seconds' first tokens, or
        the age of the longest-waiting request when that is longer."""
        if self.scheduler is None:
            return {"num_waiting": 0.0, "num_running": 0.0, "kv_usage": 0.0, "ttft_s": 0.0}
        now = time.monotonic()
        recent = [ttft for at, ttft in self.recorder.recent_ttft if now - at <= window_s]
        ttft = sum(recent) / len(recent) if recent else 0.0
        oldest = self.scheduler.waiting.oldest_arrival()
        if oldest is not None:
            ttft = max(ttft, now - oldest)
        stats = self.scheduler.stats()
        return {
            "num_waiting": float(stats["num_waiting"]),
            "num_running": float(stats["num_running"]),
            "kv_usage": float(stats["kv_usage"]),
            "ttft_s": float(ttft),
        }

    async def metrics_text(self) -> bytes:
        """This engine's metrics in the Prometheus text format."""
        return self.metrics.exposition()

    async def health(self) -> tuple[bool, str]:
        """Healthy when a ping travels through every rank and back."""
        if self.dead_reason is not None:
            return False, self.dead_reason
        if self.control.sleep_level is not None:  # no ranks to ping, by the operator's will
            return True, "asleep"
        try:
            async with self.step_lock:
                await self._drain()
                if self.dead_reason is not None:  # the drain met a bug
                    return False, self.dead_reason
                await self.ranks.ping()
        except RankFailure as exc:
            # An idle engine learns of a dead rank here: restart it now.
            await self._recover(exc)
            # Healthy again once replaced: failing Serve's check now would make it tear
            # down this replica and the requests it is recomputing.
            return self.dead_reason is None, self.dead_reason or "ok"
        return True, "ok"

    async def worker_nodes(self) -> list[dict]:
        return await self.ranks.placement()
