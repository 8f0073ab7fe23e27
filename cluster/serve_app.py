"""iterserve on Ray Serve: an OpenAI-compatible ingress over data-parallel engines.

::

    client ──HTTP──▶ OpenAIIngress (FastAPI)             validate · auth · tokenize
                        │ handle.options(stream=True).generate(...)   ▲ record batches
                        ▼                                             │
                     EngineServer replica 1 … N          each one EngineCore, in-process:
                        tick(): schedule → workers.execute → update → publish

Each ``EngineServer`` replica *is* a scheduler actor: it runs an ``EngineCore``
on its own event loop and owns that core's worker actors. Serve routes every
request to the less loaded of two replicas; ``max_ongoing_requests`` is set
above the engine's own queue bound, so the engine's queue — answered with a
429 — is what pushes back, not Serve's. The ingress takes at most what its
engines can hold; beyond that and a queue as long again, Serve's proxy answers
503. ``build_app`` is the entry point of
``serve run`` configs (see ``deploy/serve-config.example.yaml``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from ray.serve import Application

from iterserve.cluster import resources
from iterserve.cluster.config import EngineConfig
from iterserve.cluster.engine_core import EngineCore
from iterserve.cluster.gc_pauses import freeze_startup_objects
from iterserve.cluster.metrics_hub import HUB_NAME, get_or_create_hub, render
from iterserve.cluster.openai.app import APISettings, build_api
from iterserve.cluster.openai.errors import EngineRefusal
from iterserve.cluster.openai.serving import OpenAIServing

logger = logging.getLogger(__name__)

ACCEPTED = ("accepted", "")  # first item of an accepted generate() stream
CONSUMER_ID = "replica"  # the one consumer of an in-process EngineCore
ENGINE_HEADROOM = 64  # requests an engine replica takes beyond its own bounds (to refuse them)
# How often a stopping replica checks whether its last request has ended (Serve's
# default of 2 s made every shutdown take seconds longer than its requests).
SHUTDOWN_POLL_S = 0.25


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


def metrics_hub_name(model_name: str) -> str:
    """One metrics hub per served model: its engine replicas push, its ingress renders."""
    return f"{HUB_NAME}-{model_name}"


@serve.deployment(
    ray_actor_options={"num_cpus": resources.SCHEDULER_CPUS}, health_check_period_s=10
)
class EngineServer:
    """One data-parallel engine copy: an ``EngineCore`` running in this replica."""

    def __init__(self, config: EngineConfig, model_name: str, metrics_hub: str):
        self.core = EngineCore(
            config, model_name=model_name, engine_index=_replica_rank(), metrics_hub=metrics_hub
        )
        self.replica = _replica_name()
        self.queues: dict[str, asyncio.Queue] = {}  # engine request id -> its records
        self.next_key = itertools.count()
        self.poller: asyncio.Task | None = None
        # Start-up (worker placement, model load) runs in the background so the
        # replica answers health checks while loading; every call awaits it.
        self.started = asyncio.get_running_loop().create_task(self._start())

    async def _start(self) -> dict:
        info = await self.core.start()
        self.poller = asyncio.get_running_loop().create_task(self._poll_loop())
        return info

    async def _ready(self) -> dict:
        return await asyncio.shield(self.started)

    async def _poll_loop(self) -> None:
        # One consumer for all requests of this replica: fan records out by id.
        while True:
            try:
                records = await self.core.poll(CONSUMER_ID, timeout_s=1.0)
            except Exception:  # never let the fan-out die with requests in flight
                logger.exception("engine poll failed")
                await asyncio.sleep(0.1)
                continue
            for request_id, token_ids, logprobs, reason, error in records:
                queue = self.queues.get(request_id)
                if queue is not None:
                    queue.put_nowait((token_ids, logprobs, reason, error))

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: dict, priority: int = 0
    ):
        """Streams one request. The first item is ``ACCEPTED`` or the refusal
        ``(kind, message)``; then lists of ``(token_ids, logprobs, finish_reason,
        error)`` holding everything that arrived since the previous item. Closing
        or cancelling the stream early aborts the request.

        ``request_id`` is the client's name for the request and may repeat (two
        clients may send the same X-Request-Id); the engine knows the request by
        a key of this replica's own."""
        try:
            await self._ready()
        except Exception as exc:
            yield ("engine_dead", f"the engine failed to start: {exc}")
            return
        key = f"{request_id}@{next(self.next_key)}"
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[key] = queue
        finished = False
        try:
            refusal = await self.core.add_request(
                CONSUMER_ID, key, prompt_token_ids, params, priority, label=request_id
            )
            if refusal is not None:
                finished = True
                yield tuple(refusal)
                return
            yield ACCEPTED
            while not finished:
                batch = [await queue.get()]
                while not queue.empty():  # coalesce the steps that queued up meanwhile
                    batch.append(queue.get_nowait())
                finished = batch[-1][2] is not None
                yield batch
        finally:
            self.queues.pop(key, None)
            if not finished:
                await self.core.abort(key)

    async def info(self) -> dict:
        return {**await self._ready(), "replica": self.replica}

    async def max_model_len(self) -> int:
        return (await self._ready())["max_model_len"]

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
        return {**await self.core.stats(), "replica": self.replica, "ready": True}

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

    async def check_integrity(self) -> None:
        await self._ready()
        await self.core.check_integrity()

    async def worker_pids(self) -> list[int]:
        """The worker actors' process ids, in rank order (fault-injection tests)."""
        await self._ready()
        return await self.core.worker_pids()

    async def placement(self) -> dict:
        """Where this replica and its ranks run: node and placement group ids."""
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

    async def __del__(self) -> None:
        if self.poller is not None:
            self.poller.cancel()
        if self.started.done() and self.started.exception() is None:
            await self.core.shutdown()
        else:
            self.started.cancel()


class HandleEngineClient:
    """The HTTP layer's view of the engine replicas, through a deployment handle."""

    def __init__(self, handle):
        self.handle = handle
        self.stream_handle = handle.options(stream=True)

    async def open(self, request_id, prompt_token_ids, params, priority):
        stream = self.stream_handle.generate.remote(request_id, prompt_token_ids, params, priority)
        try:
            first = await stream.__anext__()
        except BaseException:
            stream.cancel()
            raise
        if tuple(first) != ACCEPTED:
            # The replica's generator has ended, but Serve counts a stream as ongoing
            # until it is read to the end or cancelled: left alone, a refusal would
            # hold a slot of the replica's max_ongoing_requests (and memory here),
            # until the router queued new requests into timeouts.
            stream.cancel()
            kind, message = first
            raise EngineRefusal(kind, message)
        return stream

    async def info(self) -> dict:
        return await self.handle.info.remote()

    async def _broadcast(self, method: str, timeout_s: float) -> list:
        response = self.handle.broadcast(method)
        return await response.results_async(timeout_s=timeout_s, return_exceptions=True)

    async def stats(self) -> list[dict]:
        return [r for r in await self._broadcast("stats", 30) if isinstance(r, dict)]

    async def health(self) -> list[dict]:
        return [
            r
            if isinstance(r, dict)
            else {"healthy": False, "ready": False, "message": f"{type(r).__name__}: {r}"}
            # A health ping waits for the step in flight; probes want an answer soon.
            for r in await self._broadcast("health", 10)
        ]


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    """The HTTP front: every route of the OpenAI-compatible API."""

    def __init__(self, engine, config: EngineConfig, args: ServeArgs):
        from iterserve.workers.tokenizer import Tokenizer

        api_key = args.api_key
        if api_key is None and args.api_key_env is not None:
            # The key is read here, on the ingress's node, and never travels in configs.
            api_key = os.environ.get(args.api_key_env) or None
            if api_key is None:
                raise RuntimeError(
                    f"api_key_env names {args.api_key_env}, which is not set on this node; "
                    "refusing to serve without the key"
                )
        self.settings = APISettings(
            api_key=api_key,
            max_body_bytes=args.max_body_bytes,
            add_request_id_header=False,
            metrics_require_api_key=args.metrics_require_api_key,
            cors_allowed_origins=tuple(args.cors_allowed_origins),
            cors_allow_credentials=args.cors_allow_credentials,
        )
        self.metrics_hub = metrics_hub_name(args.served_model_name(config))
        self.serving = OpenAIServing(
            HandleEngineClient(engine),
            Tokenizer(config.model_path),
            model_name=args.served_model_name(config),
            max_n=config.scheduler.max_n,
            max_logprobs=config.scheduler.max_logprobs,
            request_timeout_s=args.request_timeout_s,
            strict_fields=args.strict_fields,
            tool_call_parser=args.tool_call_parser,
        )
        freeze_startup_objects()  # a full collection would stall every stream it serves

    def __serve_build_asgi_app__(self):
        return build_api(self.serving, self.settings, self.metrics_body)

    async def metrics_body(self) -> bytes:
        hub = get_or_create_hub(self.metrics_hub)
        return render(await hub.collect.remote())


class ServeArgs(BaseModel):
    """Arguments of ``build_app`` (the ``args`` of a ``serve run`` config)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None, description="Checkpoint directory; unset serves the bundled demo model."
    )
    config: dict[str, Any] = Field(
        default_factory=dict, description="EngineConfig keys (policy, max_num_seqs, ...)."
    )
    num_engine_replicas: int = Field(1, ge=1, description="Data-parallel engine copies.")
    api_key_env: str | None = Field(
        None, description="Environment variable holding the API key; unset: no auth."
    )
    api_key: str | None = Field(None, description="The API key itself (tests); prefer api_key_env.")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="Largest request body in bytes.")
    model_name: str | None = Field(
        None, description="Name clients use in `model`; default: the checkpoint's directory name."
    )
    request_timeout_s: float | None = Field(
        600.0, gt=0, description="A request still running after this long is aborted (504)."
    )
    health_check_period_s: float = Field(
        10.0, gt=0, description="How often Serve checks each engine replica's workers."
    )
    ingress_cpus: float = Field(
        resources.INGRESS_CPUS,
        gt=0,
        description="CPUs the HTTP ingress replica reserves (Ray only uses it to place it).",
    )
    strict_fields: bool = Field(
        False, description="Refuse request fields the server does not know (default: ignore)."
    )
    tool_call_parser: str | None = Field(
        None, description="How tool calls are read from the output: hermes or llama3_json."
    )
    cors_allowed_origins: list[str] = Field(
        default_factory=list, description="Origins browsers may call from (* for any)."
    )
    cors_allow_credentials: bool = Field(False, description="Let browsers send credentials.")
    metrics_require_api_key: bool = Field(True, description="Whether /metrics needs the key.")

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, value):
        from iterserve.cluster.openai.tool_parsers import TOOL_CALL_PARSERS

        if value is not None and value not in TOOL_CALL_PARSERS:
            raise ValueError(f"must be one of {', '.join(TOOL_CALL_PARSERS)}, got {value!r}")
        return value

    def engine_config(self) -> EngineConfig:
        config = dict(self.config)
        if self.model is not None:
            if config.get("model") not in (None, self.model):
                raise ValueError("model is given twice (args.model and config.model) and differs")
            config["model"] = self.model
        return EngineConfig.from_dict(config)

    def served_model_name(self, config: EngineConfig) -> str:
        return self.model_name or Path(config.model_path).name


def build_app(args: dict[str, Any] | ServeArgs) -> Application:
    """The Serve application: ``import_path: iterserve.cluster.serve_app:build_app``."""
    args = args if isinstance(args, ServeArgs) else ServeArgs.model_validate(args)
    config = resources.resolve(args.engine_config(), num_engine_replicas=args.num_engine_replicas)
    # Above the engine's own bound, so the engine refuses (429) before Serve queues.
    per_engine = config.scheduler.max_queue_len + config.scheduler.max_num_seqs + ENGINE_HEADROOM
    engine = EngineServer.options(
        num_replicas=args.num_engine_replicas,
        max_ongoing_requests=per_engine,
        health_check_period_s=args.health_check_period_s,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        # A health check pings through the step lock: it may wait out one slow step.
        health_check_timeout_s=config.step_timeout_s + 30,
        # The scheduler and its ranks reserved together: with PACK they share a node,
        # and steps reach the ranks over Unix sockets.
        placement_group_bundles=resources.engine_bundles(config),
        placement_group_strategy=config.placement_strategy,
    ).bind(config, args.served_model_name(config), metrics_hub_name(args.served_model_name(config)))
    # The ingress holds no more than its engines can take; the proxy queues a bounded
    # number more and answers 503 beyond that. Unbounded, a burst faster than the
    # HTTP path itself can turn around piled up in the ingress (memory, then 504s).
    ingress = OpenAIIngress.options(
        ray_actor_options={"num_cpus": args.ingress_cpus},
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        max_ongoing_requests=args.num_engine_replicas * per_engine,
        max_queued_requests=args.num_engine_replicas * per_engine,
    )
    return ingress.bind(engine, config, args)
