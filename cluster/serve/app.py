"""iterserve on Ray Serve: an OpenAI-compatible ingress over data-parallel engines.

::

    client ──HTTP──▶ OpenAIIngress replica(s)        validate · auth · tokenize · detokenize
                        │ engine channel (a socket): requests in,   ▲ one frame per step
                        ▼                                          │ with every stream's tokens
                     EngineServer replica 1 … N       each one EngineCore, in-process:
                        tick(): schedule → submit → collect → update → publish

Serve runs, places, health-checks and replaces both deployments; requests and
tokens travel on the engine channels (:mod:`~iterserve.cluster.engine.channel`), not on Serve's
request path, and with ``http_port`` set the ingress answers HTTP itself
(:mod:`~iterserve.cluster.serve.ingress`), without Serve's proxy. The ingress routes each request to the
replica with the fewest of its requests in flight. It takes at most what its
engines can hold (``num_engine_replicas × (max_queue_len + max_num_seqs + 64)``)
and answers 503 beyond; each engine's own bounded queue answers 429.
``build_app`` is the entry point of ``serve run`` configs (see
``deploy/serve-config.example.yaml``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray.serve import Application

from ..config import EngineConfig
from ..engine.server import EngineServer
from ..metrics.hub import HUB_NAME
from ..ranks.executors import ExecutorFactory
from . import resources
from .ingress import OpenAIIngress

ENGINE_HEADROOM = 64  # requests an engine replica takes beyond its own bounds (to refuse them)
# How often a stopping replica checks whether its last request has ended (Serve's
# default of 2 s made every shutdown take seconds longer than its requests).
SHUTDOWN_POLL_S = 0.25


def metrics_hub_name(model_name: str) -> str:
    """One metrics hub per served model: its engine replicas push, its ingress renders."""
    return f"{HUB_NAME}-{model_name}"


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
    routing: Literal["prefix", "load"] = Field(
        "prefix",
        description="How the ingress spreads requests over engine replicas: prefix (to the "
        "one likely to hold the prompt's prefix, load as the bound) or load alone.",
    )
    http_host: str = Field(
        "127.0.0.1", description="Where the ingress answers HTTP itself, with http_port."
    )
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="The port the ingress answers HTTP on, without Serve's proxy (set "
        "proxy_location: Disabled); unset: behind Serve's proxy.",
    )

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, value):
        from ..openai.tool_parsers import TOOL_CALL_PARSERS

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

    def max_ongoing_requests(self, config: EngineConfig) -> int:
        """What the ingress takes at once: what its engines can hold or refuse."""
        per_engine = config.scheduler.max_queue_len + config.scheduler.max_num_seqs
        return self.num_engine_replicas * (per_engine + ENGINE_HEADROOM)


def build_app(args: dict[str, Any] | ServeArgs) -> Application:
    """The Serve application: ``import_path: iterserve.cluster.serve.app:build_app``
    (Serve hands a builder the config's ``args``, and nothing else)."""
    return build_application(args)


def build_application(
    args: dict[str, Any] | ServeArgs, executor: ExecutorFactory | None = None
) -> Application:
    """The Serve application, for code: ``executor`` builds what the ranks run
    instead of the model (:mod:`~iterserve.cluster.ranks.executors`), which no
    config can ask for."""
    args = args if isinstance(args, ServeArgs) else ServeArgs.model_validate(args)
    config = resources.resolve(args.engine_config(), num_engine_replicas=args.num_engine_replicas)
    name = args.served_model_name(config)
    engine = EngineServer.options(
        num_replicas=args.num_engine_replicas,
        health_check_period_s=args.health_check_period_s,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        # A health check pings through the step lock: it may wait out one slow step.
        health_check_timeout_s=config.step_timeout_s + 30,
        # The scheduler and its ranks reserved together: with PACK they share a node,
        # and steps reach the ranks over Unix sockets.
        placement_group_bundles=resources.engine_bundles(config),
        placement_group_strategy=config.placement_strategy,
    ).bind(config, name, metrics_hub_name(name), executor)
    # Behind Serve's proxy, the proxy bounds what the ingress holds and queues; an
    # ingress answering HTTP itself bounds it in its own gate (503 beyond).
    bound = args.max_ongoing_requests(config)
    ingress = OpenAIIngress.options(
        ray_actor_options={"num_cpus": args.ingress_cpus},
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        max_ongoing_requests=bound,
        max_queued_requests=bound,
    )
    return ingress.bind(engine, config, args)
