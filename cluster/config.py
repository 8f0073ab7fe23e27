"""The engine's one frozen configuration.

Plain frozen dataclasses, no I/O. ``EngineConfig.from_dict`` is the edge where
untrusted dicts (Serve YAML, Helm values, CLI files) come in: unknown keys and
wrong types are refused with a message naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from iterserve.scheduler.config import POLICIES, SchedulerConfig

EXECUTORS = ("model", "fake")
# What the fake executor takes (FakeExecutor's keywords, and the checkpoint facts it
# stands in for). Anything else is refused: a deployment config cannot reach test code.
FAKE_EXECUTOR_OPTIONS = (
    "vocab_size", "eos_token_id", "output_len", "step_sleep_s", "check_blocks", "max_model_len",
)  # fmt: skip
STEP_TRANSPORTS = ("auto", "socket", "compiled_graph", "actor_calls")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (a scheduler actor and its workers) needs.

    model: checkpoint directory; ``None`` serves the bundled demo model.
    dtype: ``auto`` | ``float32`` | ``float16`` | ``bfloat16``.
    tensor_parallel_size: worker ranks; heads and MLP columns are split across them.
    num_kv_blocks: KV blocks per rank; ``None`` sizes the cache from free memory
        times ``kv_memory_fraction`` (on CPU, at most 1 GiB).
    max_model_len: context length; ``None`` takes the checkpoint's, capped at 4096.
    step_timeout_s: a step that takes longer is a hung worker: the group restarts.
    max_restarts: worker-group restarts before in-flight requests fail with an error.
    placement_strategy: ``PACK`` (one node) or ``SPREAD`` (across nodes).
    step_transport: how a step's plan reaches the ranks. ``socket`` (what ``auto``
        picks): the plan encoded once and written to one stream socket per rank
        (Unix on the scheduler's node, TCP beyond), no core held while waiting;
        ``compiled_graph``: one write into a Ray compiled graph (shared memory,
        ~0.5 ms, but the scheduler and every rank busy-wait on a core each, even
        idle; one node only); ``actor_calls``: one actor call per rank per step.
    async_scheduling: build each step's plan while the step before it runs, so the
        ranks go from one step to the next without waiting for the scheduler (with
        the ``socket`` and ``compiled_graph`` transports); ``False`` schedules each
        step only once the previous result is in.
    num_cpus_per_worker: CPUs each rank reserves; ``None`` derives it from the node
        (see :mod:`~iterserve.cluster.resources`: 1 with a GPU; on a CPU node all
        but one core, shared by the node's ranks).
    torch_threads: the ranks' torch threads; ``None``: as many as reserved CPUs.
    ray_metrics: also export the engine's metrics through Ray's own metrics agent.
    executor: ``model`` runs the checkpoint; ``fake`` a deterministic stand-in
        (tests, benchmarks of the control plane); ``module:attr`` any factory
        ``(config, rank, world_size, all_reduce) -> executor``.
    """

    model: str | None = None
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    device: str = "auto"
    kernel_backend: str = "auto"
    policy: str = "chunked"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_memory_fraction: float = 0.3
    kv_layout: str = "paged"
    max_queue_len: int = 1024
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    batch_timeout_s: float = 1.0
    batch_wait_s: float = 0.02
    max_n: int = 16
    max_logprobs: int = 20
    step_timeout_s: float = 60.0
    max_restarts: int = 3
    placement_strategy: str = "PACK"
    step_transport: str = "auto"
    async_scheduling: bool = True
    num_cpus_per_worker: float | None = None
    torch_threads: int | None = None
    ray_metrics: bool = True
    executor: str = "model"
    executor_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError("kv_memory_fraction must be in (0, 1]")
        if self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be > 0")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if self.num_cpus_per_worker is not None and not self.num_cpus_per_worker > 0:
            raise ValueError(f"num_cpus_per_worker must be > 0, got {self.num_cpus_per_worker}")
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(
                f"placement_strategy must be PACK or SPREAD, got {self.placement_strategy!r}"
            )
        if self.step_transport not in STEP_TRANSPORTS:
            raise ValueError(
                f"step_transport must be one of {', '.join(STEP_TRANSPORTS)}, "
                f"got {self.step_transport!r}"
            )
        if self.executor not in EXECUTORS and ":" not in self.executor:
            raise ValueError(f"executor must be model, fake or module:attr, got {self.executor!r}")
        allowed = {"model": (), "fake": FAKE_EXECUTOR_OPTIONS}.get(self.executor)
        if allowed is not None:
            unknown = sorted(set(self.executor_options) - set(allowed))
            if unknown:
                raise ValueError(
                    f"executor_options of the {self.executor} executor: unknown keys "
                    f"{', '.join(unknown)} (allowed: {', '.join(allowed) or 'none'})"
                )

    def scheduler_config(self, *, num_kv_blocks: int, max_model_len: int) -> SchedulerConfig:
        """The scheduler's share of this config, with the two values only known once
        the workers have loaded the checkpoint."""
        shared = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(SchedulerConfig)
            if f.name not in ("num_kv_blocks", "max_model_len")
        }
        return SchedulerConfig(**shared, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len)

    @property
    def model_path(self) -> str:
        if self.model is not None:
            return self.model
        from iterserve.models import DEMO_MODEL_PATH

        return str(DEMO_MODEL_PATH)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        if not isinstance(data, dict):
            raise ValueError(f"engine config must be a mapping, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"unknown engine config keys: {', '.join(unknown)}")
        for key, value in data.items():
            _check_type(key, value, fields[key].type)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_TYPES = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "dict[str, Any]": (dict,),
}


def _check_type(key: str, value: Any, annotation: str) -> None:
    optional = annotation.endswith("| None")
    base = annotation.removesuffix(" | None")
    if value is None:
        if optional:
            return
        raise ValueError(f"{key} must not be null")
    allowed = _TYPES.get(base, (object,))
    if isinstance(value, bool) and bool not in allowed:
        raise ValueError(f"{key} must be {base}, got a boolean")
    if not isinstance(value, allowed):
        raise ValueError(f"{key} must be {base}, got {type(value).__name__}")
