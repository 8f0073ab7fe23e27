"""The HTTP front as a Serve deployment: every route of the OpenAI-compatible API.

With ``http_port`` set (what ``iterserve serve``, the example configs and the
Helm chart do), each ``OpenAIIngress`` replica answers HTTP itself, on its own
event loop, and Serve's proxy is not started: a streamed token then crosses
two processes (rank → engine replica → ingress → client) instead of four, and
no Ray message is sent per token at all. Several replicas of one app on one
node share the port (``SO_REUSEPORT``), and only they: a port held by anything
else refuses the replica's start (:mod:`~iterserve.cluster.serve.ports`).
Without ``http_port`` the same ASGI app sits behind Serve's proxy, as any Serve
ingress.

A stopping ingress (a redeploy, the server's shutdown) keeps accepting until
another replica of its deployment runs (a redeploy starts its successor at the
same moment, on the same port, which they share), or the app is being deleted,
or ``drain_timeout_s`` passed; then it stops accepting and lets the connections
it has finish their responses, streams included, for up to ``drain_timeout_s``
and a margin before it closes them. A connection the kernel has already queued
on its listener is served, not reset, when it stops accepting
(:func:`stop_accepting`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time

from ray import serve

from ..config import EngineConfig
from ..gc_pauses import freeze_startup_objects
from ..metrics.hub import get_or_create_hub, render
from ..openai.app import APISettings, build_api
from ..openai.serving import OpenAIServing
from . import ports, resources
from .replicas import ChannelEngineClient
from .routing import PrefixRouter

logger = logging.getLogger(__name__)
DRAIN_MARGIN_S = 5.0  # beyond drain_timeout_s: the last outputs travel to their clients
LINGER_POLL_S = 0.5  # how often a stopping ingress looks whether its successor runs
REQUEST_GRACE_S = 1.0  # a connection accepted last has this long to send its request


def _successor_runs() -> bool:
    """Whether a stopping ingress may stop accepting: another replica of its
    deployment runs, or none will (the app is being deleted, or Serve cannot say)."""
    try:
        context = serve.get_replica_context()
        app = serve.status().applications.get(context.app_name)
        if app is None or app.status == "DELETING":
            return True
        deployment = app.deployments.get(context.deployment)
        return deployment is None or deployment.replica_states.get("RUNNING", 0) > 0
    except Exception:  # outside Serve, or Serve going away
        return True


async def stop_accepting(server, listener: socket.socket, grace_s: float = REQUEST_GRACE_S) -> None:
    """Closes uvicorn ``server``'s ``listener`` without losing a connection on it.

    Closing a listening socket resets every connection the kernel had queued on
    it and nobody had accepted yet, although the port's other listeners (a
    redeploy's successor) would have taken them: so they are accepted in the same
    step that closes it, with nothing in between, and served like any other.
    uvicorn, once told to exit, closes each connection that has no request under
    way, so a connection accepted last gets ``grace_s`` to send its request first.
    Call it before setting ``server.should_exit``.
    """
    queued = ports.accept_queued(listener)
    for asyncio_server in server.servers:
        asyncio_server.close()  # closes the listener: nothing is accepted after the drain
    config, loop = server.config, asyncio.get_running_loop()

    def protocol():
        return config.http_protocol_class(
            config=config, server_state=server.server_state, app_state=server.lifespan.state
        )

    for connection in queued:
        await loop.connect_accepted_socket(protocol, connection)
    await asyncio.sleep(grace_s)


def openai_serving(engines, config: EngineConfig, args, settings: dict) -> OpenAIServing:
    """The API over ``engines`` as ``args`` (:class:`~.app.ServeArgs`) configure it: the
    served names, the chat template, the sampling defaults (an ingress's, run-batch's).
    ``settings``: what GET /version shows of how the server runs."""
    from ...workers.tokenizer import Tokenizer
    from .model_files import chat_template_text, sampling_defaults

    tokenizer = Tokenizer(config.model_path)
    if args.chat_template is not None:
        tokenizer.chat_template = chat_template_text(args.chat_template)
    names = args.served_model_names(config)
    serving = OpenAIServing(
        engines,
        tokenizer,
        model_name=names[0],
        max_n=config.scheduler.max_n,
        max_logprobs=config.scheduler.max_logprobs,
        request_timeout_s=args.request_timeout_s,
        strict_fields=args.strict_fields,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
        runner=config.runner,
        normalize_embeddings=config.pooling_normalize,
        settings=settings,
    )
    serving.model_aliases = tuple(names[1:])
    serving.sampling_defaults = sampling_defaults(
        args.generation_config, config.model_path, args.override_generation_config
    )
    return serving


@serve.deployment(ray_actor_options={"num_cpus": resources.INGRESS_CPUS})
@serve.ingress()
class OpenAIIngress:
    """The HTTP front: every route of the OpenAI-compatible API."""

    def __init__(self, engine, config: EngineConfig, args):
        from ..openai.responses.store import shared_store, store_name
        from .app import metrics_hub_name

        self.server = None  # uvicorn's, when this replica answers HTTP itself
        self.server_task: asyncio.Task | None = None
        self.listener: socket.socket | None = None
        self.port_claim: socket.socket | None = None  # held while it listens (ports.py)
        self.drain_timeout_s = config.drain_timeout_s
        api_key = None
        if args.api_key_env is not None:
            # The key is read here, on the ingress's node, and never travels in configs.
            api_key = os.environ.get(args.api_key_env) or None
            if api_key is None:
                raise RuntimeError(
                    f"api_key_env names {args.api_key_env}, which is not set on this node; "
                    "refusing to serve without the key"
                )
        direct = args.http_port is not None
        self.settings = APISettings(
            api_key=api_key,
            max_body_bytes=args.max_body_bytes,
            # Serve's proxy sets X-Request-Id itself; answering directly, the app does.
            add_request_id_header=direct,
            metrics_require_api_key=args.metrics_require_api_key,
            cors_allowed_origins=tuple(args.cors_allowed_origins),
            cors_allow_credentials=args.cors_allow_credentials,
            max_ongoing_requests=args.max_ongoing_requests(config) if direct else None,
        )
        self.metrics_hub = metrics_hub_name(args.served_model_name(config))
        router = None
        if args.routing == "prefix" and config.scheduler.prefix_caching:
            router = PrefixRouter(config.scheduler.block_size)
        self.engines = ChannelEngineClient(engine, router)
        self.serving = openai_serving(
            self.engines,
            config,
            args,
            {
                "policy": config.scheduler.policy,
                "max_num_seqs": config.scheduler.max_num_seqs,
                "prefix_caching": config.scheduler.prefix_caching,  # on, and a policy using it
                "engine_replicas": args.num_engine_replicas,
                "routing": args.routing if router is not None else "load",
            },
        )
        if config.enable_lora:
            from ..lora import AdapterDirectory

            self.serving.lora = AdapterDirectory(self.engines, args.served_model_name(config))
        # Stored Responses API responses: one actor per served model, every replica's.
        store = shared_store(store_name(args.served_model_name(config)))
        self.serving.response_store = store
        self.asgi = build_api(self.serving, self.settings, self.metrics_body)
        if direct:
            app = ports.app_key(serve.get_replica_context().app_name)
            self.listener, self.port_claim = ports.listen(args.http_host, args.http_port, app)
            self.server_task = asyncio.get_running_loop().create_task(
                self._serve_http(self.listener)
            )
        freeze_startup_objects()  # a full collection would stall every stream it serves

    async def _serve_http(self, sock: socket.socket) -> None:
        import uvicorn

        config = uvicorn.Config(
            self.asgi,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=30,
            # On stopping: responses in flight (streams the engines drain) finish first.
            timeout_graceful_shutdown=self.drain_timeout_s + DRAIN_MARGIN_S,
        )
        self.server = uvicorn.Server(config)
        try:
            await self.server.serve(sockets=[sock])
        except Exception:
            logger.exception("the ingress's HTTP server stopped")
            raise

    def __serve_build_asgi_app__(self):
        return self.asgi

    async def metrics_body(self) -> bytes:
        hub = get_or_create_hub(self.metrics_hub)
        return render(await hub.collect.remote())

    async def __del__(self) -> None:
        if self.server is not None:
            deadline = time.monotonic() + self.drain_timeout_s
            while time.monotonic() < deadline and not await asyncio.to_thread(_successor_runs):
                await asyncio.sleep(LINGER_POLL_S)
            if self.listener is not None and self.server.started:
                await stop_accepting(self.server, self.listener)
            self.server.should_exit = True
            if self.server_task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(
                        asyncio.shield(self.server_task), self.drain_timeout_s + DRAIN_MARGIN_S
                    )
        if self.port_claim is not None:  # after the listener: its port is no longer held
            self.port_claim.close()
        self.engines.close()
