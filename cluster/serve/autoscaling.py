"""Engine replicas scaled on the engine's own signals, by Serve's autoscaler.

Serve's default policy counts the requests that pass through its handles; ours
travel on the engine channels, so it would see every replica idle. Instead each
engine replica reports its load (``EngineServer.record_autoscaling_stats``:
requests waiting and running, the share of its KV blocks in use, its time to
first token), Serve averages each over ``look_back_period_s``, and
:class:`EngineAutoscalingPolicy` turns them into a replica count::

    pressure = max( (waiting + running) / (replicas × target_ongoing_requests),
                    mean KV usage / target_kv_usage,
                    worst TTFT / target_ttft_s )
    desired  = ceil(replicas × pressure), within [min_replicas, max_replicas]

A pressure above 1 asks for more replicas, below 1 for fewer. Serve applies
``upscale_delay_s`` and ``downscale_delay_s`` (a decision must hold that long)
and the bounds. A replica it removes drains first (docs/deploy.md). Replicas
that do not fit the cluster stay pending, which is what makes the Ray autoscaler
(KubeRay's, with the chart's ``autoscaling`` values) add a node for them.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

POLICY_PATH = "iterserve.cluster.serve.autoscaling:EngineAutoscalingPolicy"
SIGNALS = ("num_waiting", "num_running", "kv_usage", "ttft_s")  # what a replica reports


class AutoscalingArgs(BaseModel):
    """The ``autoscaling`` of a Serve config's ``args``: engine replicas between
    ``min_replicas`` and ``max_replicas`` on the engines' load."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=1, description="Engine replicas kept at all times.")
    max_replicas: int = Field(2, ge=1, description="Engine replicas at most.")
    target_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="Requests (running and waiting) one replica should carry; unset: its "
        "max_num_seqs, so that requests start waiting only when every replica is full.",
    )
    target_kv_usage: float = Field(
        0.9, gt=0, le=1, description="Share of a replica's KV blocks in use to aim for."
    )
    target_ttft_s: float = Field(
        2.0,
        ge=0,
        description="Time to first token to stay under (the worst replica's); 0: not a signal.",
    )
    upscale_delay_s: float = Field(
        5.0, ge=0, description="How long more replicas must be wanted before they start."
    )
    downscale_delay_s: float = Field(
        60.0, ge=0, description="How long fewer replicas must do before one is drained."
    )
    look_back_period_s: float = Field(
        10.0, gt=0, description="The window Serve averages each replica's signals over."
    )
    metrics_interval_s: float = Field(
        1.0,
        gt=0,
        description="How often each replica sends its signals to Serve's controller (Serve's "
        "default, 10 s, would let a load wait that long before anything scales).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingArgs:
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"look_back_period_s ({self.look_back_period_s}) must be longer than "
                f"metrics_interval_s ({self.metrics_interval_s})"
            )
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be at least "
                f"min_replicas ({self.min_replicas})"
            )
        return self

    def serve_config(self, max_num_seqs: int) -> dict[str, Any]:
        """Serve's ``autoscaling_config`` for the engine deployment."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.min_replicas,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            # Serve's replicas push their metrics at this interval (the field is marked
            # deprecated for an environment variable that the replicas do not read yet).
            "metrics_interval_s": self.metrics_interval_s,
            "policy": {
                "policy_function": POLICY_PATH,
                "policy_kwargs": {
                    "target_ongoing_requests": self.target_ongoing_requests or max_num_seqs,
                    "target_kv_usage": self.target_kv_usage,
                    "target_ttft_s": self.target_ttft_s,
                },
            },
        }


class EngineAutoscalingPolicy:
    """Serve's autoscaling policy for engine replicas (see the module docstring);
    Serve builds it with the ``policy_kwargs`` of :meth:`AutoscalingArgs.serve_config`."""

    def __init__(
        self,
        target_ongoing_requests: float = 16,
        target_kv_usage: float = 0.9,
        target_ttft_s: float = 2.0,
    ):
        self.target_ongoing_requests = target_ongoing_requests
        self.target_kv_usage = target_kv_usage
        self.target_ttft_s = target_ttft_s

    def pressure(self, metrics: dict[str, dict[Any, float]], replicas: int) -> dict[str, float]:
        """Each signal's demand relative to what ``replicas`` replicas should carry."""

        def values(name: str) -> list[float]:
            return list(metrics.get(name, {}).values())

        ongoing = sum(values("num_waiting")) + sum(values("num_running"))
        kv = values("kv_usage")
        ttft = values("ttft_s")
        found = {
            "ongoing": ongoing / (replicas * self.target_ongoing_requests),
            "kv_usage": (sum(kv) / len(kv) if kv else 0.0) / self.target_kv_usage,
        }
        if self.target_ttft_s > 0:
            found["ttft"] = max(ttft, default=0.0) / self.target_ttft_s
        return found

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        replicas = ctx.current_num_replicas
        if replicas == 0:  # nothing reports yet: keep what Serve is starting
            return ctx.target_num_replicas, {}
        metrics = ctx.aggregated_metrics or {}
        if not any(metrics.get(name) for name in SIGNALS):  # no report yet: hold
            return ctx.target_num_replicas, {}
        pressure = self.pressure(metrics, replicas)
        desired = math.ceil(replicas * max(pressure.values()) - 1e-9)
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        return max(low, min(high, desired)), {"pressure": pressure}
