"""The engine's one frozen configuration, with the scheduler's nested inside.

Plain frozen dataclasses, no I/O. Every knob is declared once, with
:func:`~iterserve.scheduler.config.knob` (default, documentation, bounds);
the README's table and the Helm chart are generated from the declarations
(:mod:`iterserve.cluster.config_docs`). ``EngineConfig.from_dict`` is the edge
where untrusted dicts (Serve YAML, Helm values, CLI files) come in: one flat
mapping of keys, the scheduler's among them; unknown keys and wrong types are
refused with a message naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..scheduler.config import SchedulerConfig, check_knobs, knob

DTYPES = ("auto", "float32", "float16", "bfloat16")
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
RUNNERS = ("generate", "pooling")
# The quantization methods served (workers/quant: METHODS and vLLM's aliases of them).
QUANTIZATIONS = ("compressed-tensors", "gptq", "awq", "fp8", "gptq_marlin", "awq_marlin",
                 "compressed_tensors")  # fmt: skip
POOLING_TYPES = ("LAST", "MEAN")  # vLLM's pooler config names
SCHEDULER_KEYS = frozenset(f.name for f in dataclasses.fields(SchedulerConfig))


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (a scheduler actor and its ranks) needs; the
    scheduler's own knobs are in ``scheduler``."""

    model: str | None = knob(
        None,
        "Hugging Face checkpoint directory (architectures: docs/model-runtime.md)",
        helm=False,
        shown_default="demo model",
    )
    dtype: str = knob(
        "auto",
        "weights, activations and KV cache: `float32`, `float16` or `bfloat16`; `auto`: "
        "bf16 on a CPU with AMX, fp32 on one without a bf16 dot product, measured at load on "
        "one with avx512_bf16 but no AMX; the checkpoint's on GPU (`/version` says which and "
        "why)",
        choices=DTYPES,
    )
    quantization: str | None = knob(
        None,
        "the weights' quantization, as vLLM names it: unset reads the checkpoint's "
        "`quantization_config` (compressed-tensors W8A8 / W4A16 / FP8, GPTQ, AWQ, FP8; "
        "docs/model-runtime.md); a method given must be the checkpoint's; `fp8` on a dense "
        "checkpoint quantizes its projections at load (weight-only on a CPU)",
        choices=QUANTIZATIONS,
    )
    seed: int = knob(
        0,
        "seed of the ranks' shared sampling generator, which requests without a seed of "
        "their own draw from (a request's `seed` makes its tokens its own, whatever the batch)",
        minimum=0,
    )
    tensor_parallel_size: int = knob(
        1, "tensor-parallel ranks; attention heads and MLP columns are split across them", minimum=1
    )
    batch_invariant: bool = knob(
        False,
        "compute every row in an order of its own: a request's logits, and so its greedy and "
        "seeded tokens, do not depend on what shares its steps, how its prompt is cut into "
        "pieces or whether it is preempted (docs/model-runtime.md, Reproducible outputs)",
    )
    device: str = knob("auto", "`auto` (CUDA when present), `cpu` or `cuda`", helm=False)
    kernel_backend: str = knob(
        "auto",
        "`auto` (Triton on CUDA; `cpu` elsewhere: attention, norms and rotary compiled by "
        "numba, products on oneDNN-packed weights), `triton`, `cpu` or `torch`",
        choices=("auto", "triton", "cpu", "torch"),
        helm=False,
    )
    reasoning_parser: str | None = knob(
        None,
        "split a thinking model's `<think>` block off its answer: `qwen3` or `deepseek_r1` "
        "(docs/serving.md, Reasoning output)",
        choices=("qwen3", "deepseek_r1"),
        helm=False,
    )
    runner: str = knob(
        "generate",
        "`generate` (completions, chat, responses) or `pooling`: the checkpoint's hidden states "
        "pooled into embeddings (`/v1/embeddings`; docs/serving.md, Embeddings)",
        choices=RUNNERS,
    )
    pooling_type: str = knob(
        "LAST",
        "how a pooling runner pools a prompt's final hidden states: `LAST` (its last token's) "
        "or `MEAN` (every token's mean; prefix caching is then off)",
        choices=POOLING_TYPES,
    )
    pooling_normalize: bool = knob(
        True, "a pooling runner's embeddings are L2-normalised (a request's `normalize` wins)"
    )
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_memory_fraction: float = knob(
        0.3,
        "share of free memory (after the weights) the KV cache fills when `num_kv_blocks` is "
        "unset; on CPU at most 1 GiB",
        exclusive_minimum=0,
        maximum=1,
        helm_default=0.8,
    )
    kv_offloading_size: float = knob(
        0.0,
        "GiB of host memory in all (across tensor-parallel ranks) for KV blocks leaving the "
        "device: found there again by a later prompt, or by a preempted sequence swapped "
        "back; 0: none (docs/serving.md, KV cache tiers)",
        minimum=0,
    )
    kv_disk_cache_dir: str | None = knob(
        None,
        "directory of the disk tier under the host tier: blocks kept across restarts, "
        "one directory per model fingerprint, each rank its own files; unset: none "
        "(the chart: `kvDiskCache.volume`)",
        helm=False,
    )
    kv_disk_cache_size: float = knob(
        10.0,
        "GiB of files the disk tier keeps (per engine replica), least recently used deleted first",
        exclusive_minimum=0,
    )
    kv_events_config: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": "KV cache events, vLLM's keys: `{enable_kv_cache_events, publisher: zmq, "
            "endpoint, replay_endpoint, topic, buffer_steps, hwm}`; each engine replica "
            "binds the endpoint's port plus its index (`/v1/stats` lists them); empty: none",
            "helm": False,
        },
    )
    step_timeout_s: float = knob(
        60.0, "a step slower than this is a hung rank: restart and recompute", exclusive_minimum=0
    )
    max_restarts: int = knob(
        3,
        "rank-group restarts within `restart_window_s` before in-flight requests fail and "
        "the engine replica reports itself dead (Serve then replaces it)",
        minimum=0,
    )
    restart_window_s: float = knob(
        600.0, "the window `max_restarts` counts restarts in", exclusive_minimum=0
    )
    drain_timeout_s: float = knob(
        30.0,
        "how long a stopping engine replica (scale-down, redeploy, SIGTERM) lets its requests "
        "run on; those still running then end with an error that says so",
        minimum=0,
    )
    placement_strategy: str = knob(
        "PACK",
        "Ray placement of one engine copy's ranks (`PACK`, `SPREAD` across nodes, `STRICT_*`)",
        choices=PLACEMENTS,
        helm_default="STRICT_PACK",
    )
    async_scheduling: bool = knob(
        True, "build each step's plan while the step before it runs; `false`: one at a time"
    )
    num_cpus_per_worker: float | None = knob(
        None,
        "CPUs each rank reserves; unset: derived from the node (README, What each process "
        "reserves)",
        exclusive_minimum=0,
        helm=False,
        shown_default="derived",
    )
    torch_threads: int | None = knob(
        None, "the ranks' torch threads; unset: as many as reserved CPUs", minimum=1, helm=False
    )
    ray_metrics: bool = knob(
        False,
        "also export the engine's metrics through Ray's metrics agent (the dashboards read "
        "the ingress's /metrics; the mirror costs the scheduler CPU on every token)",
        helm=False,
    )
    enable_lora: bool = knob(
        False,
        "serve LoRA adapters: `lora_modules` at start, `POST /v1/load_lora_adapter` at "
        "runtime; a request's `model` names one (docs/serving.md, LoRA adapters)",
    )
    lora_modules: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": "adapters loaded at start: `{name: path}` or `{name: {path, "
            "base_model_name}}` (PEFT checkpoint directories; implies `enable_lora`)",
            "helm": False,
        },
    )
    max_lora_rank: int = knob(
        16, "largest rank an adapter may have (with `enable_lora`)", minimum=1, maximum=64
    )
    max_cpu_loras: int | None = knob(
        None,
        "adapters each rank keeps read in host memory, so an evicted one reloads without "
        "reading its files; unset: `max_loras`",
        minimum=1,
        shown_default="max_loras",
    )

    def __post_init__(self) -> None:
        check_knobs(self)
        from .lora import normalize_lora_modules

        object.__setattr__(self, "lora_modules", normalize_lora_modules(self.lora_modules))
        if self.lora_modules and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)
        self._check_kv_tiers()
        if self.runner == "pooling" and self.pooling_type == "MEAN":
            # A mean needs every token's hidden state: none may be skipped as cached.
            scheduler = dataclasses.replace(self.scheduler, enable_prefix_caching=False)
            object.__setattr__(self, "scheduler", scheduler)

    def _check_kv_tiers(self) -> None:
        from .engine.kv_events import check_kv_events_config

        object.__setattr__(self, "kv_events_config", check_kv_events_config(self.kv_events_config))
        if self.kv_disk_cache_dir and not self.kv_offloading_size:
            raise ValueError(
                "kv_disk_cache_dir: the disk tier reads and writes through host memory; "
                "set kv_offloading_size too"
            )
        if self.kv_offloading_size and not self.scheduler.prefix_caching:
            raise ValueError(
                "kv_offloading_size: the KV tiers keep prefix-cached blocks; it needs "
                "enable_prefix_caching with the continuous or chunked policy (paged layout)"
            )

    @property
    def rank_max_loras(self) -> int:
        """Adapter slots each rank holds: ``max_loras`` with LoRA enabled, else none."""
        return self.scheduler.max_loras if self.enable_lora else 0

    @property
    def model_path(self) -> str:
        if self.model is not None:
            return self.model
        from ..models import DEMO_MODEL_PATH

        return str(DEMO_MODEL_PATH)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (the scheduler's keys among them) applied."""
        ours = {k: v for k, v in changes.items() if k not in SCHEDULER_KEYS}
        theirs = {k: v for k, v in changes.items() if k in SCHEDULER_KEYS}
        if theirs:
            ours["scheduler"] = dataclasses.replace(self.scheduler, **theirs)
        return dataclasses.replace(self, **ours)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """The config from one flat mapping of keys (the scheduler's among them)."""
        if not isinstance(data, dict):
            raise ValueError(f"engine config must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"scheduler"}
        unknown = sorted(set(data) - known - SCHEDULER_KEYS)
        if unknown:
            raise ValueError(f"unknown engine config keys: {', '.join(unknown)}")
        for key, value in data.items():
            if value is None and key not in _NULLABLE:
                raise ValueError(f"{key} must not be null")
        return cls().replace(**data)


_NULLABLE = {
    f.name
    for config in (EngineConfig, SchedulerConfig)
    for f in dataclasses.fields(config)
    if str(f.type).endswith("| None")
}
