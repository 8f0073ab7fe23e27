"""The engine API: ``AsyncEngine`` for servers, ``LLM`` for offline batch jobs.

``AsyncEngine`` starts (or attaches to) one scheduler actor, which starts its
worker actors. Each client process polls the actor once per batch of steps and
fans the records out to per-request queues, so streaming costs one actor call
per step for all requests together.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field

import ray

from iterserve.cluster.config import EngineConfig
from iterserve.cluster.engine_core import EngineCore
from iterserve.scheduler import PromptTooLongError, QueueFullError, SamplingParams


class EngineError(RuntimeError):
    """The engine could not serve a request (its workers failed, or it is gone)."""


class EngineDeadError(EngineError):
    """The engine's workers are gone and could not be restarted."""


class InvalidRequestError(ValueError):
    """The request was refused for its content; the message names the problem."""


@dataclass(slots=True)
class GenerationOutput:
    """New tokens of one request since its previous output."""

    request_id: str
    token_ids: list[int]
    logprobs: list = field(default_factory=list)  # (logprob, [(token_id, logprob), ...]) per token
    finish_reason: str | None = None  # eos | stop_token | length | abort | error
    error: str | None = None
    # On the first output with tokens: prompt tokens found in the prefix cache.
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_REFUSALS = {
    "invalid": InvalidRequestError,
    "model_not_found": InvalidRequestError,  # a LoRA adapter that is not loaded
    "queue_full": QueueFullError,
    "engine_dead": EngineDeadError,
}


def start_scheduler_actor(config: EngineConfig, name: str | None = None):
    """Creates the scheduler actor (it owns the clock, so it must not be restarted
    behind the clients' back: ``max_restarts=0``)."""
    actor_cls = ray.remote(EngineCore)
    options = {"num_cpus": 0, "max_concurrency": 10_000, "max_restarts": 0}
    if name:
        options["name"] = name
    return actor_cls.options(**options).remote(config)


class AsyncEngine:
    def __init__(self, config: EngineConfig, actor=None):
        self.config = config
        self.actor = actor
        self.consumer_id = uuid.uuid4().hex
        self.next_key = itertools.count()
        self.queues: dict[str, asyncio.Queue] = {}  # engine request id -> its outputs
        self.keys: dict[str, set[str]] = {}  # caller's request id -> its engine request ids
        self.poller: asyncio.Task | None = None
        self.info: dict = {}
        self.error: str | None = None

    async def start(self) -> AsyncEngine:
        if self.actor is None:
            self.actor = start_scheduler_actor(self.config)
            self.info = await self.actor.start.remote()
        self.poller = asyncio.get_running_loop().create_task(self._poll_loop())
        return self

    @property
    def max_model_len(self) -> int:
        return self.info.get("max_model_len", 0)

    async def _poll_loop(self) -> None:
        while True:
            try:
                records = await self.actor.poll.remote(self.consumer_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the actor is gone: end every stream with an error
                self.error = f"the engine is unavailable: {type(exc).__name__}: {exc}"
                for queue in list(self.queues.values()):
                    queue.put_nowait(([], [], "error", self.error, None))
                await asyncio.sleep(0.5)
                continue
            for key, *record in records:
                queue = self.queues.get(key)
                if queue is not None:
                    queue.put_nowait(record)

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> AsyncIterator[GenerationOutput]:
        """Streams a request's new tokens. Leaving the loop early aborts the request.

        ``request_id`` names the request in the outputs and in ``abort``; it need
        not be unique (the engine gets a key of this client's own).
        Raises InvalidRequestError, PromptTooLongError, QueueFullError or
        EngineDeadError before the first output when the request is refused.
        ``lora_name`` names a loaded LoRA adapter to generate with.
        """
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        key = f"{self.consumer_id}:{next(self.next_key)}"
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[key] = queue
        self.keys.setdefault(request_id, set()).add(key)
        finished = False
        try:
            wire = asdict(params)
            if lora_name is not None:
                wire["lora_name"] = lora_name
            refusal = await self.actor.add_request.remote(
                self.consumer_id, key, list(prompt_token_ids), wire, priority, request_id
            )
            if refusal is not None:
                finished = True
                kind, message = refusal
                if kind == "prompt_too_long":
                    raise PromptTooLongError(len(prompt_token_ids), self.max_model_len)
                raise _REFUSALS[kind](message)
            while True:
                out = GenerationOutput(request_id, *await queue.get())
                if out.finished:
                    finished = True
                    if out.finish_reason == "error":
                        raise EngineError(out.error or "the engine failed this request")
                yield out
                if finished:
                    return
        finally:
            self.queues.pop(key, None)
            keys = self.keys.get(request_id, set())
            keys.discard(key)
            if not keys:
                self.keys.pop(request_id, None)
            if not finished:
                with contextlib.suppress(Exception):
                    await self.actor.abort.remote(key)

    async def abort(self, request_id: str) -> bool:
        """Aborts every running request of this client named ``request_id``."""
        keys = list(self.keys.get(request_id, ()))
        results = [await self.actor.abort.remote(key) for key in keys]
        return any(results)

    async def stats(self) -> dict:
        return await self.actor.stats.remote()

    async def health(self) -> tuple[bool, str]:
        return await self.actor.health.remote()

    async def shutdown(self) -> None:
        if self.poller is not None:
            self.poller.cancel()
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
        self.engine = self.loop.run_until_complete(AsyncEngine(self.config).start())
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from iterserve.workers.tokenizer import Tokenizer

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
