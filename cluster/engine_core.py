"""The scheduler actor: owns the iteration clock, the slot table and the workers.

Its loop is one tick after another::

    plan    = scheduler.schedule(now)     # who runs, how many tokens, which blocks
    result  = await workers.execute(plan) # one broadcast, one reply
    outputs = scheduler.update(result)    # append tokens, finish, free slots and KV
    publish(outputs)                      # to each consumer's buffer

With ``async_scheduling`` the next plan is built and sent while a step runs,
and the result is taken after::

    submit(step N)                        # from the previous tick (or now, from idle)
    submit(scheduler.schedule(now))       # step N+1, built ahead (None when it can't be)
    outputs = scheduler.update(await collect(step N))
    publish(outputs)

so the ranks start N+1 the moment N ends, and the scheduler's own work for a
step (update, publish, schedule, encode) overlaps the next step's forward.

It sleeps while there is no work and wakes on arrival. Consumers (engine
clients in other processes) fetch their requests' outputs with one long-poll
call per batch of steps, never one call per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import ray

from iterserve.cluster.config import EngineConfig
from iterserve.cluster.gc_pauses import freeze_startup_objects
from iterserve.cluster.metrics import EngineMetrics
from iterserve.cluster.recorder import MetricsRecorder
from iterserve.cluster.worker_group import Submitted, WorkerFailure, WorkerGroup
from iterserve.scheduler import (
    FinishReason,
    PromptTooLongError,
    QueueFullError,
    Request,
    RequestOutput,
    SamplingParams,
    SamplingParamsError,
    Scheduler,
    StepPlan,
)

logger = logging.getLogger(__name__)
METRICS_PUSH_INTERVAL_S = 1.0  # a scrape sees the engines at most this stale

# One published record: (request_id, new_token_ids, new_logprobs, finish_reason, error)
Record = tuple[str, list[int], list, str | None, str | None]


class EngineCore:
    """``model_name`` and ``engine_index`` label this engine's metrics; with
    ``metrics_hub`` set, the metrics are pushed to that hub actor for the ingress."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        model_name: str | None = None,
        engine_index: int = 0,
        metrics_hub: str | None = None,
    ):
        self.config = config
        self.metrics = EngineMetrics(
            model_name or Path(config.model_path).name,
            engine_index,
            config.policy,
            ray_metrics=config.ray_metrics and ray.is_initialized(),
        )
        self.recorder = MetricsRecorder(self.metrics)
        self.metrics_hub = metrics_hub
        self.engine_key = f"{self.metrics.model_name}/{engine_index}"
        self.push_task: asyncio.Task | None = None
        self.workers = WorkerGroup(config)
        self.scheduler: Scheduler | None = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.owner: dict[str, str] = {}  # request_id -> consumer_id
        self.buffers: dict[str, list[Record]] = defaultdict(list)
        self.ready_events: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.wake = asyncio.Event()
        self.loop_task: asyncio.Task | None = None
        self.step_lock = asyncio.Lock()
        # The step handed to the workers and not yet collected, between ticks:
        # (its plan, its replies, when its scheduling began).
        self.in_flight: tuple[StepPlan, Submitted, float] | None = None
        self.last_result_at = 0.0
        self.dead_reason: str | None = None
        self.num_restarts = 0
        self.counters: dict[str, int] = defaultdict(int)
        # Wall time of whole steps vs the workers' own forward time: the difference
        # is the control plane's cost (schedule, broadcast, collect, update) that the
        # steps do not hide; ``steps_ahead`` counts plans built while a step ran.
        self.timing = {"steps": 0, "step_s": 0.0, "forward_s": 0.0, "steps_ahead": 0}

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> dict:
        await self.workers.start()
        info = self.workers.model_info
        limit = info["max_model_len"]
        self.max_model_len = min(self.config.max_model_len or min(limit, 4096), limit)
        self.vocab_size = info["vocab_size"]
        self.scheduler = Scheduler(
            self.config.scheduler_config(
                num_kv_blocks=self.workers.num_kv_blocks, max_model_len=self.max_model_len
            )
        )
        self.recorder.state(self.scheduler)
        freeze_startup_objects()
        loop = asyncio.get_running_loop()
        self.loop_task = loop.create_task(self._loop())
        if self.metrics_hub:
            from iterserve.cluster.metrics_hub import push_periodically

            self.push_task = loop.create_task(
                push_periodically(self.metrics, self.engine_key, hub_name=self.metrics_hub,
                                  interval_s=METRICS_PUSH_INTERVAL_S)
            )
        return {
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "num_kv_blocks": self.workers.num_kv_blocks,
        }

    async def shutdown(self) -> None:
        for task in (self.loop_task, self.push_task):
            if task is not None:
                task.cancel()
        await self.workers.shutdown()

    # -- the loop ---------------------------------------------------------------------

    @property
    def schedules_ahead(self) -> bool:
        return self.config.async_scheduling and self.workers.pipelines

    async def _loop(self) -> None:
        try:
            while True:
                if not self.scheduler.has_work and self.in_flight is None:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                try:
                    ran = await self.tick()
                except WorkerFailure as exc:
                    await self._recover(exc)
                    continue
                if not ran:  # waiting for a batch to fill (static, dynamic)
                    await self._sleep_until(self.scheduler.next_deadline())
        except Exception as exc:  # a bug: the scheduler's state can no longer be trusted
            logger.exception("the engine loop failed")
            await self._stop_serving(f"the engine failed: {type(exc).__name__}: {exc}")

    async def _stop_serving(self, message: str) -> None:
        """Fails every request at once and reports unhealthy from now on, so that
        nobody waits on an engine that no longer steps; under Serve the health
        check then replaces this replica."""
        self.in_flight = None
        self._fail_all(message)
        try:
            await self.workers.stop()
        except Exception:  # the ranks may be the broken part; they are gone either way
            logger.exception("stopping the workers failed")

    async def tick(self) -> bool:
        """Takes back one step's result; hands the workers the step after it first,
        when it can be built ahead. False when there was nothing to run."""
        async with self.step_lock:
            current, self.in_flight = self.in_flight, None
            if current is None:
                current = await self._submit_next()
                if current is None:
                    return False
            if self.schedules_ahead and self.scheduler.has_work:
                self.in_flight = await self._submit_next()
                self.timing["steps_ahead"] += self.in_flight is not None
            outputs = await self._collect(current)
        self.publish(outputs)
        return True

    async def _submit_next(self) -> tuple[StepPlan, Submitted, float] | None:
        started = time.perf_counter()
        plan = self.scheduler.schedule(time.monotonic())
        if plan is None:
            return None
        return plan, await self.workers.submit(plan), started

    async def _collect(self, flight: tuple[StepPlan, Submitted, float]) -> list[RequestOutput]:
        plan, submitted, started = flight
        result = await self.workers.collect(submitted)
        outputs = self.scheduler.update(result)
        now = time.perf_counter()
        # The step's time on the critical path: from the previous result when it was
        # built ahead, else from the start of its scheduling.
        step_s = now - max(started, self.last_result_at)
        self.last_result_at = now
        self.timing["steps"] += 1
        self.timing["step_s"] += step_s
        self.timing["forward_s"] += result.forward_s
        self.counters["padding_tokens"] += result.num_padding_tokens
        self.recorder.step(plan, result, step_s, self.scheduler)
        return outputs

    async def _drain(self) -> None:
        """Collects the step in flight (under ``step_lock``), so that nothing runs
        behind a health check or an integrity check."""
        if self.in_flight is not None:
            flight, self.in_flight = self.in_flight, None
            self.publish(await self._collect(flight))

    async def _sleep_until(self, deadline: float | None) -> None:
        self.wake.clear()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(self.wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _recover(self, exc: WorkerFailure) -> None:
        """Preempts every running sequence for recompute and restarts the workers;
        once restarts are exhausted, every in-flight request ends with an error."""
        logger.error("worker failure: %s", exc)
        async with self.step_lock:
            if exc.generation != self.workers.generation:
                return  # a failure of a group already replaced (a step and a ping both saw it)
            self.in_flight = None  # lost with the workers, as is any step before it
            self.scheduler.requeue_running()
            if self.num_restarts >= self.config.max_restarts:
                self._fail_all(f"the engine's workers failed and could not be restarted: {exc}")
                await self.workers.stop()
                return
            self.num_restarts += 1
            self.recorder.worker_restart()
            try:
                await self.workers.restart()
            except Exception as restart_exc:  # any start-up failure ends service
                self._fail_all(f"restarting the engine's workers failed: {restart_exc}")

    def _fail_all(self, message: str) -> None:
        """Ends every request with an error; works from the consumers' side too, so
        that a scheduler whose state is broken cannot keep a request from ending."""
        self.dead_reason = message
        for request_id in {*self.scheduler.requests, *self.owner}:
            try:
                self.scheduler.finish_with_error(request_id)
            except Exception:
                logger.exception("%s: ending it in the scheduler failed", request_id)
            self._push(request_id, (request_id, [], [], FinishReason.ERROR.value, message))
            self.recorder.finished(request_id, FinishReason.ERROR.value)
            self.counters["finished_error"] += 1
        with contextlib.suppress(Exception):
            self.recorder.state(self.scheduler)

    # -- publishing -------------------------------------------------------------------

    def publish(self, outputs: list[RequestOutput]) -> None:
        self.recorder.outputs(outputs)
        for out in outputs:
            reason = out.finish_reason.value if out.finish_reason else None
            self.counters["generation_tokens"] += len(out.new_token_ids)
            if reason is not None:
                self.counters[f"finished_{reason}"] += 1
            self._push(
                out.request_id, (out.request_id, out.new_token_ids, out.new_logprobs, reason, None)
            )

    def _push(self, request_id: str, record: Record) -> None:
        consumer = self.owner.get(request_id)
        if consumer is None:
            return
        if record[3] is not None:
            del self.owner[request_id]
        self.buffers[consumer].append(record)
        self.ready_events[consumer].set()

    async def poll(self, consumer_id: str, timeout_s: float = 1.0) -> list[Record]:
        """Everything published for ``consumer_id`` since its last poll; waits up to
        ``timeout_s`` for something to arrive."""
        event = self.ready_events[consumer_id]
        if not self.buffers.get(consumer_id):
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                return []
        records = self.buffers.pop(consumer_id, [])
        event.clear()
        return records

    # -- requests ---------------------------------------------------------------------

    async def add_request(
        self,
        consumer_id: str,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        priority: int = 0,
        label: str = "",
    ) -> tuple[str, str] | None:
        """Queues a request. Returns None, or ``(kind, message)`` when refused:
        kind is ``invalid``, ``prompt_too_long``, ``queue_full`` or ``engine_dead``.

        ``request_id`` must be unique among the engine's requests: consumers make
        it so themselves (never from what a client sends). ``label`` is the
        client's own name for the request, for logs; it may repeat."""
        if self.dead_reason is not None:
            return ("engine_dead", self.dead_reason)
        try:
            sampling = SamplingParams(**params)
            sampling.check_limits(
                max_n=self.config.max_n,
                max_logprobs=self.config.max_logprobs,
                vocab_size=self.vocab_size,
            )
            bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token ids must be in [0, {self.vocab_size - 1}], got {bad[0]}"
                )
            request = Request(
                request_id,
                list(prompt_token_ids),
                sampling,
                arrival_time=time.monotonic(),
                priority=priority,
                label=label,
            )
            self.scheduler.add_request(request)
        except QueueFullError as exc:
            self.counters["rejected_queue_full"] += 1
            self.recorder.rejected("queue_full")
            return ("queue_full", str(exc))
        except PromptTooLongError as exc:
            return ("prompt_too_long", str(exc))
        except (SamplingParamsError, ValueError, TypeError) as exc:
            return ("invalid", str(exc))
        self.owner[request_id] = consumer_id
        self.counters["prompt_tokens"] += len(prompt_token_ids)
        self.recorder.admitted(request_id, len(prompt_token_ids))
        self.wake.set()
        return None

    async def abort(self, request_id: str) -> bool:
        if self.dead_reason is not None:
            return False  # every request has ended already
        out = self.scheduler.abort(request_id)
        if out is None:
            return False
        self.counters["finished_abort"] += 1
        self.recorder.finished(request_id, FinishReason.ABORT.value)
        self._push(request_id, (request_id, [], [], FinishReason.ABORT.value, None))
        return True

    # -- introspection ----------------------------------------------------------------------

    async def stats(self) -> dict:
        stats = self.scheduler.stats()
        stats.update(
            healthy=self.dead_reason is None,
            worker_restarts=self.num_restarts,
            step_transport=self.workers.transport,
            max_model_len=self.max_model_len,
            counters=dict(self.counters),
            timing=dict(self.timing),
        )
        return stats

    async def metrics_text(self) -> bytes:
        """This engine's metrics in the Prometheus text format."""
        return self.metrics.exposition()

    async def check_integrity(self) -> None:
        async with self.step_lock:
            await self._drain()
            self.scheduler.check_integrity()

    async def health(self) -> tuple[bool, str]:
        """Healthy when a ping travels through every worker and back."""
        if self.dead_reason is not None:
            return False, self.dead_reason
        try:
            async with self.step_lock:
                await self._drain()
                await self.workers.ping()
        except WorkerFailure as exc:
            # An idle engine learns of a dead worker here: restart it now.
            await self._recover(exc)
            # Healthy again once replaced: failing Serve's check now would make it tear
            # down this replica and the requests it is recomputing.
            return self.dead_reason is None, self.dead_reason or "ok"
        return True, "ok"

    async def worker_pids(self) -> list[int]:
        return await self.workers.pids()

    async def worker_nodes(self) -> list[dict]:
        return await self.workers.placement()
