"""The engine API: ``AsyncEngine`` for servers, ``LLM`` for offline batch jobs.

``AsyncEngine`` starts one scheduler actor, which starts its worker actors, and
reaches it the way an ingress reaches an engine replica: requests and their
outputs over the engine channel (:mod:`~iterserve.cluster.engine.channel`), one frame per step
for all requests together; stats and health through Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
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


def start_scheduler_actor(config: EngineConfig, executor: ExecutorFactory | None = None):
    """Creates the scheduler actor (it owns the clock, so it must not be restarted
    behind the clients' back: ``max_restarts=0``)."""
    actor_cls = ray.remote(EngineCore)
    options = {"num_cpus": 0, "max_concurrency": 10_000, "max_restarts": 0}
    return actor_cls.options(**options).remote(config, executor=executor)


class AsyncEngine:
    """One engine in this Ray cluster. ``executor`` builds what its ranks run
    (:mod:`~iterserve.cluster.ranks.executors`; None: the checkpoint's model)."""

    def __init__(self, config: EngineConfig, executor: ExecutorFactory | None = None):
        self.config = config
        self.executor = executor
        self.actor = None
        self.connection: EngineConnection | None = None
        self.labels: dict[str, set[RequestStream]] = {}  # a caller's request id -> its streams
        self.info: dict = {}

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
    ) -> AsyncIterator[EngineOutput]:
        """Streams a request's outputs. Leaving the loop early aborts the request.

        ``request_id`` is the caller's name for the request (a label: it names the
        request in logs and in ``abort``, and need not be unique). Raises an
        :class:`EngineRefusal` before the first output when the request is refused
        (``InvalidRequestError``, ``ContextLengthError``, ``EngineBusyError``,
        ``EngineDeadError``), and ``EngineError`` when the engine fails it later.
        ``lora_name`` names a loaded LoRA adapter to generate with.
        """
        params = params or SamplingParams()
        label = request_id or uuid.uuid4().hex
        wire = asdict(params)
        if lora_name is not None:
            wire["lora_name"] = lora_name
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
        if self.connection is not None:
            self.connection.close()
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
    token ids. Starts a local Ray instance when none is running.
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
        self._tokenizer = None

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
        self.loop.run_until_complete(self.engine.shutdown())
        self.loop.close()
