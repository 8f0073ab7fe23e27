"""Pause, resume, sleep and wake one engine: the engine's side of vLLM's operator
routes (``/pause``, ``/resume``, ``/sleep``, ``/wake_up``; docs/serving.md).

**Pause** stops the engine's loop at a step boundary: the steps in flight are
collected and their tokens published, then nothing runs until ``resume``. What
becomes of the requests in the engine is the ``mode``'s:

- ``abort``: each ends at once, finish reason ``abort`` (what its client sees);
- ``wait``: each runs to its end first; requests arriving meanwhile wait beside
  the scheduler (checked, and bounded by ``max_queue_len``) and queue once the
  engine is empty;
- ``keep``: each stays where it is, slot, KV blocks and place in the queue, and
  goes on at ``resume``: no token is produced while paused, none is lost.

Requests arriving while paused queue (the queue's bound still refuses with 429)
and start at ``resume``.

**Sleep** pauses (by ``mode``), hands every running sequence back to the queue
to be recomputed, since its KV goes (the recovery path of a lost rank), and
stops the ranks: their processes end, and with them the weights, the KV cache
and everything built over them, host and device memory alike; the placement
stays reserved. ``wake_up`` starts the ranks again with the same KV cache size,
reloading the weights from the checkpoint, and resumes a pause that the sleep
made. Levels 1 and 2 release the same: vLLM's level 1 keeps a copy of the
weights in host memory for a faster wake; here the checkpoint is that copy.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

from ...scheduler import Request
from ...scheduler.messages import EngineOutput
from .errors import EngineBusyError

if TYPE_CHECKING:
    from .core import EngineCore

logger = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_LEVELS = (1, 2)
WAIT_POLL_S = 0.05  # how often a wait-mode pause (and a sleep) looks whether it is done
RANK_EXIT_TIMEOUT_S = 30.0  # what a sleep waits for its ranks' processes to end


class EngineStateError(RuntimeError):
    """An operator call the engine's state does not allow (resume while asleep)."""


class PauseControl:
    """Whether an engine steps, and its ranks' sleep. The engine's loop parks itself
    here (:meth:`park`) while ``paused``; every transition runs under one lock."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.paused = False  # the loop takes no step
        self.parked = asyncio.Event()  # the loop has stopped, nothing in flight
        self.holding = False  # a wait-mode pause waits for the engine to empty
        self.held: list[Request] = []  # who arrived meanwhile, in order
        self.by_sleep = False  # the pause is the sleep's: wake_up resumes
        self.sleep_level: int | None = None  # asleep at this level (None: awake)
        self.lock = asyncio.Lock()

    # -- the loop's side ------------------------------------------------------------

    async def park(self) -> None:
        """Collects the steps in flight (their tokens go out), then waits for
        ``resume``; called by the engine's loop while ``paused``."""
        core = self.core
        async with core.step_lock:
            await core._drain()
        core.outputs.flush()
        self.parked.set()
        try:
            while self.paused and core.dead_reason is None:
                core.wake.clear()
                await core.wake.wait()
        finally:
            self.parked.clear()

    def hold(self, request: Request) -> tuple[str, str] | None:
        """Keeps a request that arrived during a wait-mode pause, within the queue's
        bound; the refusal ``(kind, message)`` beyond it."""
        bound = self.core.config.scheduler.max_queue_len
        if len(self.held) + len(self.core.scheduler.waiting) >= bound:
            return (EngineBusyError.kind, f"the engine's queue is full ({bound} waiting)")
        self.held.append(request)
        return None

    # -- the operator's side --------------------------------------------------------

    async def pause(self, mode: str) -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        async with self.lock:
            aborted = await self._pause(mode)
            self.by_sleep = False
        return {**self.state(), "mode": mode, "aborted": aborted}

    async def _pause(self, mode: str) -> int:
        core = self.core
        if mode == "wait" and not self.paused:
            self.holding = True
            while core.scheduler.requests and core.dead_reason is None and self.holding:
                await asyncio.sleep(WAIT_POLL_S)
        await self._stop_loop()
        aborted = 0
        if mode == "abort":
            for request_id in list(core.scheduler.requests):
                aborted += await core.abort(request_id)
            for request in self.held:
                core.outputs.push(request.client, EngineOutput.aborted(request.request_id))
            aborted += len(self.held)
            self.held.clear()
        self._queue_held()
        core.outputs.flush()
        return aborted

    async def _stop_loop(self) -> None:
        """Sets ``paused`` and waits until the loop has parked (or ended)."""
        core = self.core
        self.paused = True
        core.wake.set()
        loop_task = core.loop_task
        while not self.parked.is_set() and loop_task is not None and not loop_task.done():
            parked = asyncio.ensure_future(self.parked.wait())
            await asyncio.wait({parked, loop_task}, return_when=asyncio.FIRST_COMPLETED)
            parked.cancel()

    def _queue_held(self) -> None:
        """The requests held during a wait, into the queue, in the order they came."""
        core = self.core
        self.holding = False
        held, self.held = self.held, []
        for request in held:
            try:
                core.scheduler.add_request(request)
            except Exception as exc:  # an adapter unloaded meanwhile, ...
                core.outputs.push(request.client, EngineOutput.failed(request.request_id, str(exc)))
                continue
            core.recorder.admitted(request)

    async def resume(self) -> dict[str, Any]:
        async with self.lock:
            if self.sleep_level is not None:
                raise EngineStateError("the engine is asleep: POST /wake_up first")
            self._resume()
        return self.state()

    def _resume(self) -> None:
        self._queue_held()
        self.paused = self.by_sleep = False
        self.core.wake.set()

    async def sleep(self, level: int, mode: str) -> dict[str, Any]:
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level: must be 1 or 2, got {level!r}")
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        core = self.core
        async with self.lock:
            if self.sleep_level is None:
                by_sleep = not self.paused
                aborted = await self._pause(mode)
                async with core.step_lock:
                    # Their KV goes with the ranks: recomputed after the wake, no token lost.
                    core.scheduler.requeue_running()
                    ranks = await core.ranks.placement()
                    await core.ranks.stop()
                    await _until_ended(ranks)
                self.by_sleep, self.sleep_level = by_sleep, level
                logger.info("engine asleep (level %d, %d requests aborted)", level, aborted)
        return self.state()

    async def wake_up(self) -> dict[str, Any]:
        core = self.core
        async with self.lock:
            if self.sleep_level is not None:
                ranks = core.ranks
                # The same cache the scheduler counts, whatever memory is free now.
                blocks = core.scheduler.config.num_kv_blocks
                ranks.config = ranks.config.replace(num_kv_blocks=blocks)
                async with core.step_lock:
                    await ranks.start()
                self.sleep_level = None
                if self.by_sleep:
                    self._resume()
                logger.info("engine awake")
        return self.state()

    def state(self) -> dict[str, Any]:
        return {"paused": self.paused, "sleeping": self.sleep_level is not None,
                "sleep_level": self.sleep_level}  # fmt: skip


async def _until_ended(ranks: list[dict], timeout_s: float = RANK_EXIT_TIMEOUT_S) -> None:
    """Waits until the processes of ``ranks`` (their placements) on this node have
    ended, so that their memory is back when the sleep answers (Ray ends a killed
    actor's process on its own time); ranks on other nodes are not waited for."""
    import ray

    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    pids = [r["pid"] for r in ranks if r.get("NodeID") == here]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while pids and asyncio.get_running_loop().time() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        if pids:
            await asyncio.sleep(WAIT_POLL_S)
    if pids:
        logger.warning("ranks %s still run %g s after they were stopped", pids, timeout_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process now has the number
        return False
    return True
