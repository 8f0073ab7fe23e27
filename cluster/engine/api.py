"""The engine API: ``AsyncEngine`` for servers, ``LLM`` for offline batch jobs.

``AsyncEngine`` starts one scheduler actor, which starts its rank actors, and
reaches it the way an ingress reaches an engine replica: requests and their
outputs over the engine channel (:mod:`~iterserve.cluster.engine.channel`), one frame per step
for all requests together; stats and health through Ray.

Both close themselves: ``shutdown()``, the end of a ``with`` / ``async with``
block, garbage collection, or the interpreter's exit releases the engine actor,
its ranks and their sockets. At exit that happens before Ray's own exit hook
stops the Ray this process started (``_release_at_exit`` is registered after it,
and exit hooks run last-registered first), so the engine shuts down in order
instead of being killed under a reader task whose loop is already gone.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass

import ray

from ...scheduler import SamplingParams
from ...scheduler.messages import EngineOutput
from ..config import EngineConfig
from ..ranks.executors import ExecutorFactory
from .connection import EngineConnection, RequestStream
from .core import EngineCore
from .errors import (
    ContextLengthError,
    EngineBusyError,
    EngineDeadError,
    EngineError,
    EngineRefusal,
    EngineUnavailableError,
    InvalidRequestError,
)

__all__ = [
    "LLM",
    "AsyncEngine",
    "Completion",
    "ContextLengthError",
    "EngineBusyError",
    "EngineDeadError",
    "EngineError",
    "EngineRefusal",
    "EngineUnavailableError",
    "InvalidRequestError",
]


SHUTDOWN_TIMEOUT_S = 30.0  # an engine's orderly shutdown, when nothing waits for it otherwise

# What still has to be released at exit: one finalizer per live engine and LLM, oldest first.
_unreleased: list[weakref.finalize] = []


def _releases_at_exit(owner: object, release, *args) -> weakref.finalize:
    """Runs ``release(*args)`` once: when ``owner`` is collected, or at exit."""
    finalizer = weakref.finalize(owner, release, *args)
    finalizer.atexit = False  # ours below runs it, before Ray's exit hook
    _unreleased[:] = [f for f in _unreleased if f.alive]
    _unreleased.append(finalizer)
    return finalizer


@atexit.register
def _release_at_exit() -> None:
    # The newest first: an LLM before the engine it holds. Each is detached and its
    # release called here: weakref.finalize's own exit hook (registered when the
    # process makes its first finalizer, which may be after this module's import)
    # may already have run, and after it calling a finalizer does nothing.
    while _unreleased:
        detached = _unreleased.pop().detach()
        if detached is not None:
            _, release, args, _ = detached
            release(*args)


def _release_engine(actor, connection: EngineConnection) -> None:
    """An engine nobody shut down (collected, or the interpreter exits): its
    connection closes on its own loop, and the actor shuts down (its ranks, its
    sockets). With no loop running in this thread it waits for both and kills the
    actor; inside a running loop it must not block, so it only asks, and Ray ends
    the actor once the shutdown ran and no handle is left."""
    loop, here = connection.task.get_loop(), _running_loop()
    if loop.is_running():
        loop.call_soon_threadsafe(connection.close)
    elif not loop.is_closed() and here is None:  # asyncio.run closes it after the reader
        connection.close()
        loop.run_until_complete(asyncio.wait([connection.task]))
    if not ray.is_initialized():  # someone stopped Ray first: the actor went with it
        return
    done = actor.shutdown.remote()
    if here is None:
        with contextlib.suppress(Exception):
            ray.get(done, timeout=SHUTDOWN_TIMEOUT_S)
        ray.kill(actor)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def start_scheduler_actor(config: EngineConfig, executor: ExecutorFactory | None = None):
    """Creates the scheduler actor (it owns the clock, so it must not be restarted
    behind the clients' back: ``max_restarts=0``)."""
    actor_cls = ray.remote(EngineCore)
    options = {"num_cpus": 0, "max_concurrency": 10_000, "max_restarts": 0}
    return actor_cls.options(**options).remote(config, executor=executor)


class AsyncEngine:
    """One engine in this Ray cluster. ``executor`` builds what its ranks run
    (:mod:`~iterserve.cluster.ranks.executors`; None: the checkpoint's model).

    ``async with AsyncEngine(config) as engine:`` starts it and shuts it down;
    else ``await engine.start()`` and ``await engine.shutdown()``. One left
    running is released when collected or at exit (the module docstring)."""

    def __init__(self, config: EngineConfig, executor: ExecutorFactory | None = None):
        self.config = config
        self.executor = executor
        self.actor = None
        self.connection: EngineConnection | None = None
        self.labels: dict[str, set[RequestStream]] = {}  # a caller's request id -> its streams
        self.info: dict = {}
        self.release: weakref.finalize | None = None

    async def __aenter__(self) -> AsyncEngine:
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.shutdown()

    async def start(self) -> AsyncEngine:
        self.actor = start_scheduler_actor(self.config, self.executor)
        try:
            self.info = await self.actor.start.remote()
            endpoint = self.info["endpoint"]
            local = endpoint["node_id"] == ray.get_runtime_context().get_node_id()
            name = uuid.uuid4().hex[:12]
            self.connection = await EngineConnection.connect(endpoint, name, local)
        except BaseException:
            # A start that failed released its ranks; the actor goes too (and with
            # it the ranks of an engine that started but could not be reached).
            with contextlib.suppress(Exception):
                await self.actor.shutdown.remote()
            ray.kill(self.actor)
            self.actor = None
            raise
        self.release = _releases_at_exit(self, _release_engine, self.actor, self.connection)
        return self

    @property
    def max_model_len(self) -> int:
        return self.info.get("max_model_len", 0)

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_name: str | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[EngineOutput]:
        """Streams a request's outputs. Leaving the loop early aborts the request.

        ``request_id`` is the caller's name for the request (a label: it names the
        request in logs and in ``abort``, and need not be unique). Raises an
        :class:`EngineRefusal` before the first output when the request is refused
        (``InvalidRequestError``, ``ContextLengthError``, ``EngineBusyError``,
        ``EngineDeadError``), and ``EngineError`` when the engine fails it later.
        ``lora_name`` names a loaded LoRA adapter to generate with; ``tenant`` whose
        request it is (``scheduling_policy: fair`` takes turns between tenants).
        """
        params = params or SamplingParams()
        label = request_id or uuid.uuid4().hex
        wire = asdict(params)
        if lora_name is not None:
            wire["lora_name"] = lora_name
        if tenant is not None:
            wire["tenant"] = tenant
        stream = await self.connection.open(label, list(prompt_token_ids), wire, priority)
        self.labels.setdefault(label, set()).add(stream)
        try:
            async for batch in stream:
                for out in batch:
                    if out.finish_reason == "error":
                        raise EngineError(out.error or "the engine failed this request")
                    yield out
        finally:
            stream.cancel()  # nothing when it finished
            streams = self.labels.get(label, set())
            streams.discard(stream)
            if not streams:
                self.labels.pop(label, None)

    async def abort(self, request_id: str) -> bool:
        """Aborts every running request of this client named ``request_id``; each
        one's stream ends with an output whose finish reason is ``abort``."""
        streams = list(self.labels.get(request_id, ()))
        for stream in streams:
            stream.abort()
        return bool(streams)

    async def stats(self) -> dict:
        return await self.actor.stats.remote()

    async def health(self) -> tuple[bool, str]:
        return await self.actor.health.remote()

    async def shutdown(self) -> None:
        """Closes the channel, shuts the engine down and ends its actor; a second
        call does nothing."""
        if self.release is None or not self.release.detach():
            return
        self.connection.close()
        if self.connection.task.get_loop() is asyncio.get_running_loop():
            await asyncio.wait([self.connection.task])  # its requests' streams end here
        with contextlib.suppress(Exception):
            await self.actor.shutdown.remote()
        ray.kill(self.actor)


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    text: str | None = None


class LLM:
    """Offline batch generation: ``LLM(model=PATH, **config).generate(prompts, params)``.

    Prompts are strings (tokenized with the checkpoint's tokenizer) or lists of
    token ids. Starts a local Ray instance when none is running. ``with LLM(...)
    as llm:`` shuts it down at the block's end; ``shutdown()`` does it by hand,
    and one left open is shut down when collected or at exit.
    """

    def __init__(self, model: str | None = None, **config):
        if not ray.is_initialized():
            ray.init(include_dashboard=False, logging_level="ERROR")
        self.config = EngineConfig.from_dict({"model": model, **config})
        self.loop = asyncio.new_event_loop()
        try:
            self.engine = self.loop.run_until_complete(AsyncEngine(self.config).start())
        except BaseException:
            self.loop.close()
            raise
        self.release = _releases_at_exit(self, _close_llm, self.loop, self.engine)
        self._tokenizer = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from ...workers.tokenizer import Tokenizer

            self._tokenizer = Tokenizer(self.config.model_path)
        return self._tokenizer

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None
    ) -> list[Completion]:
        return self.loop.run_until_complete(self._generate(prompts, params))

    async def _generate(self, prompts, params) -> list[Completion]:
        async def one(prompt) -> Completion:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            tokens: list[int] = []
            reason = "error"
            async for out in self.engine.generate(ids, params):
                tokens.extend(out.token_ids)
                reason = out.finish_reason or reason
            text = self.tokenizer.decode(tokens) if isinstance(prompt, str) else None
            return Completion(ids, tokens, reason, text)

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    def shutdown(self) -> None:
        """Shuts the engine down and closes the loop; a second call does nothing."""
        self.release()


def _close_llm(loop: asyncio.AbstractEventLoop, engine: AsyncEngine) -> None:
    if _running_loop() is not None:  # collected inside someone's loop: not on its thread
        closer = threading.Thread(target=_close_llm, args=(loop, engine), name="llm-shutdown")
        closer.start()
        closer.join()
        return
    loop.run_until_complete(engine.shutdown())
    loop.close()
