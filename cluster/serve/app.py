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
engines can hold (``num_engine_replicas × (max_queue_len + max_num_seqs + 64)``,
``max_replicas`` with ``autoscaling``) and answers 503 beyond; each engine's own
bounded queue answers 429. With ``autoscaling`` Serve sizes the engine
deployment on the engines' own load (:mod:`~iterserve.cluster.serve.autoscaling`);
a replica that stops drains first (:mod:`~iterserve.cluster.engine.server`).
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
from .autoscaling import AutoscalingArgs
from .ingress import OpenAIIngress

ENGINE_HEADROOM = 64  # requests an engine replica takes beyond its own bounds (to refuse them)
# How often a stopping replica checks whether its last request has ended (Serve's
# default of 2 s made every shutdown take seconds longer than its requests).
SHUTDOWN_POLL_S = 0.25
# What a stopping replica gets beyond drain_timeout_s before Serve kills it: the
# last outputs' flush, the ranks' shutdown.
SHUTDOWN_MARGIN_S = 15.0


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
    autoscaling: AutoscalingArgs | None = Field(
        None,
        description="Engine replicas between min_replicas and max_replicas on the engines' "
        "load (cluster/serve/autoscaling.py); unset: num_engine_replicas, fixed.",
    )
    api_key_env: str | None = Field(
        None, description="Environment variable holding the API key; unset: no auth."
    )
    max_body_bytes: int = Field(8 << 20, ge=1024, description="Largest request body in bytes.")
    model_name: str | list[str] | None = Field(
        None,
        description="Name clients use in `model`; several: each is served, answers carry the "
        "first; default: the checkpoint's directory name.",
    )
    request_timeout_s: float | None = Field(
        600.0, gt=0, description="A request still running after this long is aborted (504)."
    )
    health_check_period_s: float = Field(
        10.0, gt=0, description="How often Serve checks each engine replica's ranks."
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
    chat_template: str | None = Field(
        None,
        description="The chat template: a file, or the template itself; unset: the checkpoint's.",
    )
    generation_config: str = Field(
        "auto",
        description="Sampling defaults for fields a request leaves unset: auto (the "
        "checkpoint's generation_config.json, as vLLM reads it), vllm (none), or a directory "
        "holding a generation_config.json.",
    )
    override_generation_config: dict[str, Any] = Field(
        default_factory=dict,
        description='Sampling defaults set over generation_config\'s, e.g. {"temperature": 0.5}.',
    )

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, value):
        from ..openai.tool_parsers import TOOL_CALL_PARSERS

        if value is not None and value not in TOOL_CALL_PARSERS:
            raise ValueError(f"must be one of {', '.join(TOOL_CALL_PARSERS)}, got {value!r}")
        return value

    @field_validator("model_name")
    @classmethod
    def _names(cls, value):
        names = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(n, str) and n for n in names):
            raise ValueError("names must be non-empty strings")
        return value

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value):
        from .model_files import chat_template_text

        return value if value is None else (chat_template_text(value) and value)

    def engine_config(self) -> EngineConfig:
        config = dict(self.config)
        if self.model is not None:
            if config.get("model") not in (None, self.model):
                raise ValueError("model is given twice (args.model and config.model) and differs")
            config["model"] = self.model
        return EngineConfig.from_dict(config)

    def served_model_name(self, config: EngineConfig) -> str:
        """The name answers carry: the first of ``model_name``'s, else the checkpoint's."""
        return self.served_model_names(config)[0]

    def served_model_names(self, config: EngineConfig) -> list[str]:
        """Every name a request's ``model`` may use for the base model."""
        if isinstance(self.model_name, list) and self.model_name:
            return list(self.model_name)
        return [self.model_name or Path(config.model_path).name]

    @property
    def initial_engine_replicas(self) -> int:
        """Engine replicas at start (what a rank's derived CPU share is sized for:
        with autoscaling, replicas beyond the minimum go to nodes the cluster adds)."""
        if self.autoscaling is not None:
            return self.autoscaling.min_replicas
        return self.num_engine_replicas

    @property
    def max_engine_replicas(self) -> int:
        """The most engine replicas there can be: the fixed count, or the autoscaler's bound."""
        if self.autoscaling is not None:
            return self.autoscaling.max_replicas
        return self.num_engine_replicas

    def max_ongoing_requests(self, config: EngineConfig) -> int:
        """What the ingress takes at once: what its engines can hold or refuse."""
        per_engine = config.scheduler.max_queue_len + config.scheduler.max_num_seqs
        return self.max_engine_replicas * (per_engine + ENGINE_HEADROOM)


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
    config = resources.resolve(
        args.engine_config(), num_engine_replicas=args.initial_engine_replicas
    )
    name = args.served_model_name(config)
    if args.autoscaling is not None:
        scaling: dict[str, Any] = {
            "autoscaling_config": args.autoscaling.serve_config(config.scheduler.max_num_seqs)
        }
    else:
        scaling = {"num_replicas": args.num_engine_replicas}
    engine = EngineServer.options(
        **scaling,
        health_check_period_s=args.health_check_period_s,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        graceful_shutdown_timeout_s=config.drain_timeout_s + SHUTDOWN_MARGIN_S,
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
        graceful_shutdown_timeout_s=config.drain_timeout_s + SHUTDOWN_MARGIN_S,
        max_ongoing_requests=bound,
        max_queued_requests=bound,
    )
    return ingress.bind(engine, config, args)
