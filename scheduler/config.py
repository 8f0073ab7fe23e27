"""The scheduler's frozen configuration. No I/O; derived values are properties.

Every knob is declared once, here or in the engine's config
(``cluster/config.py``), with :func:`knob`: its default, one line of
documentation and its bounds. The README's configuration table and the Helm
chart's values, schema and template are generated from these declarations
(``python -m iterserve.cluster.config_docs --write``; a test fails when they drift).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

POLICIES = ("static", "dynamic", "continuous", "chunked")
# Who goes first, with vLLM's names: ``priority`` (a request's priority, then its
# arrival) and ``fcfs`` (arrival alone), and ``fair`` between tenants (:mod:`.fair`).
SCHEDULING_POLICIES = ("priority", "fcfs", "fair")
TENANT_KEYS = ("weight", "ttft_slo_ms")  # what `tenants` may say of each tenant
# The default per-step token budgets. A CPU rank's step takes time in proportion to its
# tokens (the demo model on one core: ~0.1 ms a prompt token), so 2048 prompt tokens
# in one step hold every running stream for ~0.2 s; 512 keep that stall near four
# decode steps and let the first prompts of a burst start streaming sooner.
CPU_STEP_TOKENS = 512
CUDA_STEP_TOKENS = 2048
CONTEXT_CAP = 4096  # the default context when the config leaves it to the checkpoint
KV_LAYOUTS = ("paged", "slab")


def knob(
    default: Any,
    doc: str,
    *,
    choices: tuple[str, ...] | None = None,
    minimum: float | None = None,
    exclusive_minimum: float | None = None,
    maximum: float | None = None,
    helm: bool = True,
    helm_default: Any = MISSING,
    shown_default: str | None = None,
) -> Any:
    """A configuration field and what documents it.

    ``helm``: whether the chart exposes it (as ``engine.<camelCase>``);
    ``helm_default``: the chart's default when it differs (a GPU cluster's);
    ``shown_default``: how the README shows a default that is derived at start.
    An optional integer whose unset value means "derived" is 0 in the chart.
    """
    metadata = {
        "doc": doc,
        "choices": choices,
        "minimum": minimum,
        "exclusive_minimum": exclusive_minimum,
        "maximum": maximum,
        "helm": helm,
        "helm_default": helm_default,
        "shown_default": shown_default,
    }
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler batches. ``max_model_len`` and ``num_kv_blocks`` may be
    left unset in a configuration: the engine fills them in once the checkpoint
    and the KV cache are known (:meth:`resolved`); a :class:`Scheduler` needs
    them set."""

    policy: str = knob(
        "chunked",
        "batching policy: `static`, `dynamic`, `continuous` or `chunked`",
        choices=POLICIES,
    )
    max_num_seqs: int = knob(128, "slots: sequences running at once", minimum=1)
    max_num_batched_tokens: int | None = knob(
        None,
        "per-step token budget, padding included (≥ max_num_seqs); unset: 512 on CPU (up to "
        "2048 for a small model's pieces of prompts longer than 512 tokens: as many tokens as "
        "cost a 144M model's 512; not under `fair`), 2048 on CUDA, raised to max_model_len "
        "for the policies that prefill whole prompts",
        minimum=1,
        helm_default=CUDA_STEP_TOKENS,
        shown_default="by device",
    )
    max_model_len: int | None = knob(
        None,
        "prompt + output tokens of one sequence; unset: the checkpoint's, at most 4096",
        minimum=1,
        shown_default="checkpoint's, ≤ 4096",
    )
    block_size: int = knob(16, "tokens per KV block", minimum=1)
    num_kv_blocks: int | None = knob(
        None,
        "KV blocks per rank; unset: as many as `kv_memory_fraction` of free memory holds",
        minimum=1,
        shown_default="from memory",
    )
    kv_layout: str = knob(
        "paged",
        "`paged`, or `slab`: reserve `max_model_len` per sequence, for comparison",
        choices=KV_LAYOUTS,
        helm=False,
    )
    enable_prefix_caching: bool = knob(
        True,
        "reuse the KV of full blocks whose tokens an earlier request computed (continuous "
        "and chunked, paged layout); `false`: every prompt from token 0",
    )
    max_queue_len: int = knob(
        1024, "waiting requests beyond this are refused with 429 and Retry-After", minimum=0
    )
    scheduling_policy: str = knob(
        "priority",
        "who goes first: `priority` (a request's priority, then arrival; preemption takes "
        "the worst), `fcfs` (arrival only) or `fair` (tenants take turns by the tokens "
        "computed for them; continuous and chunked; docs/serving.md, Fairness between tenants)",
        choices=SCHEDULING_POLICIES,
    )
    max_queue_len_per_tenant: int | None = knob(
        None,
        "waiting requests of one tenant beyond this are refused with 429 and Retry-After "
        "(`fair`), so that a flood is refused before anyone else; unset: half of `max_queue_len`",
        minimum=1,
        shown_default="max_queue_len / 2",
    )
    tenants: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": "per-tenant settings (`fair`): `{name: {weight, ttft_slo_ms}}`; a tenant of "
            "weight 2 gets twice the tokens of one of weight 1 while both wait (unnamed: 1); "
            "`ttft_slo_ms` is its requests' first-token target unless they name their own",
            "helm": False,
        },
    )
    max_num_partial_prefills: int = knob(
        1, "prompts part-way through prefill at once (chunked)", minimum=1
    )
    long_prefill_token_threshold: int = knob(
        0, "cap on one long prompt's prefill piece per step (chunked; 0: none)", minimum=0
    )
    batch_timeout_s: float = knob(1.0, "seconds static batching waits for a full batch", minimum=0)
    batch_wait_s: float = knob(
        0.02, "seconds dynamic batching lets its oldest request wait before launching", minimum=0
    )
    max_n: int = knob(16, "largest `n` (choices per prompt) a request may ask for", minimum=1)
    max_logprobs: int = knob(20, "largest `logprobs` a request may ask for", minimum=0)
    max_loras: int = knob(
        1,
        "LoRA adapters the ranks hold at once, so the most distinct adapters one step mixes "
        "(with `enable_lora`); the least recently used idle one makes room for another",
        minimum=1,
    )
    speculative_config: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": "speculative decoding, vLLM's keys: `{method: ngram, num_speculative_tokens, "
            "prompt_lookup_min, prompt_lookup_max, disable_by_batch_size}` (continuous and "
            "chunked, paged layout; unset disable_by_batch_size: 16 on CPU, 64 on CUDA); "
            "empty: none",
            "helm": False,
        },
    )

    def __post_init__(self) -> None:
        check_knobs(self)
        self._check_speculation()
        self._check_fairness()
        budget = self.max_num_batched_tokens  # None: the engine derives it (resolved())
        if budget is not None and budget < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running sequence can decode each step"
            )
        if self.max_model_len is None:
            return
        if budget is not None and not self.chunked_prefill and budget < self.max_model_len:
            raise ValueError(
                f"policy {self.policy!r} prefills whole prompts: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < self.blocks_per_seq_max:
            raise ValueError(
                f"num_kv_blocks ({self.num_kv_blocks}) cannot hold one sequence of max_model_len "
                f"{self.max_model_len} ({self.blocks_per_seq_max} blocks of {self.block_size})"
            )

    def _check_speculation(self) -> None:
        from .speculation import SpeculativeConfig

        spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is None:
            return
        if self.policy not in ("continuous", "chunked"):
            raise ValueError(
                f"speculative_config: policy {self.policy!r} does not speculate; use "
                "continuous or chunked"
            )
        if self.kv_layout != "paged":
            raise ValueError("speculative_config: needs the paged KV layout")
        object.__setattr__(self, "speculative_config", spec.as_dict())

    def _check_fairness(self) -> None:
        from .messages import MAX_TENANT_LEN

        if self.scheduling_policy == "fair" and self.policy not in ("continuous", "chunked"):
            raise ValueError(
                f"scheduling_policy: fair shares each step among tenants; policy {self.policy!r} "
                "admits a whole batch at once: use continuous or chunked"
            )
        if self.scheduling_policy != "fair":
            for key in ("tenants", "max_queue_len_per_tenant"):
                if getattr(self, key):
                    raise ValueError(f"{key}: applies to scheduling_policy fair only")
        for name, settings in self.tenants.items():
            if type(name) is not str or not 0 < len(name) <= MAX_TENANT_LEN:
                raise ValueError(f"tenants: a name must be 1 to {MAX_TENANT_LEN} characters")
            if not isinstance(settings, dict) or set(settings) - set(TENANT_KEYS):
                raise ValueError(f"tenants: {name!r} must be a mapping of {', '.join(TENANT_KEYS)}")
            for key, value in settings.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ValueError(f"tenants: {name}.{key} must be a number > 0, got {value!r}")

    @property
    def tenant_queue_len(self) -> int:
        """Waiting requests one tenant may have (``fair``)."""
        return self.max_queue_len_per_tenant or max(1, self.max_queue_len // 2)

    @property
    def speculation(self):
        """The parsed :class:`~.speculation.SpeculativeConfig`, or None."""
        from .speculation import SpeculativeConfig

        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def chunked_prefill(self) -> bool:
        return self.policy == "chunked"

    @property
    def prefix_caching(self) -> bool:
        """Whether blocks are shared by content. Static and dynamic batching prefill
        a batch padded from position 0, and a slab is one sequence's own: neither
        shares."""
        return (
            self.enable_prefix_caching
            and self.policy in ("continuous", "chunked")
            and self.kv_layout == "paged"
        )

    @property
    def blocks_per_seq_max(self) -> int:
        from .blocks import blocks_for

        assert self.max_model_len is not None
        return blocks_for(self.max_model_len, self.block_size)

    def context_for(self, checkpoint_len: int) -> int:
        """The context an engine gives a checkpoint whose own is ``checkpoint_len``: the
        configured one, else the checkpoint's up to ``CONTEXT_CAP``; never more than
        the checkpoint's."""
        return min(self.max_model_len or min(checkpoint_len, CONTEXT_CAP), checkpoint_len)

    @property
    def token_budget(self) -> int:
        """The per-step token budget of a complete config (a Scheduler's)."""
        assert self.max_num_batched_tokens is not None, "resolved() sets it"
        return self.max_num_batched_tokens

    def step_budget(self, device: str, max_model_len: int | None = None,
                    step_tokens: int | None = None) -> int:  # fmt: skip
        """The per-step token budget on ``device`` (``cpu``, ``cuda``, ``cuda:1``): the
        configured one, else the device's default (or the model's, ``step_tokens``,
        but for ``fair``) raised to ``max_num_seqs`` and, for the policies that prefill
        whole prompts, to the context length."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        default = CUDA_STEP_TOKENS if device.startswith("cuda") else CPU_STEP_TOKENS
        if self.scheduling_policy != "fair":
            # Tenants share every step under `fair`: a longer one would make a light
            # tenant's first token wait for a heavy one's piece.
            default = step_tokens or default
        budget = max(default, self.max_num_seqs)
        context = self.max_model_len or max_model_len
        if not self.chunked_prefill and context is not None:
            budget = max(budget, context)
        return budget

    def short_budget(self, device: str, max_model_len: int | None = None,
                     step_tokens: int | None = None) -> int | None:  # fmt: skip
        """Where the model's own budget (``step_tokens``) is larger than the device's,
        the device's: what a step may spend on decodes and on prompts with no more
        than that many tokens left, so that a burst of short prompts is not taken in
        one long step and every first token made to wait for all of them; the rest
        of the budget is for pieces of longer prompts (:meth:`.StepBuilder.room_for`).
        None where the budget is one (configured, or the device's)."""
        if self.max_num_batched_tokens is not None or not step_tokens:
            return None
        short = self.step_budget(device, max_model_len)
        return short if short < self.step_budget(device, max_model_len, step_tokens) else None

    def resolved(self, *, num_kv_blocks: int, max_model_len: int, device: str,
                 step_tokens: int | None = None) -> SchedulerConfig:  # fmt: skip
        """This config with what the loaded engine decided: the cache's size, the
        context length where the config left it to the checkpoint, and the step
        budget where it left it to the device (or to the model: ``step_tokens``)."""
        from dataclasses import replace

        context = self.max_model_len or max_model_len
        speculative = self.speculative_config
        if speculative and speculative.get("disable_by_batch_size") is None:
            from .speculation import batch_limit_for

            speculative = {**speculative, "disable_by_batch_size": batch_limit_for(device)}
        return replace(
            self,
            num_kv_blocks=num_kv_blocks,
            max_model_len=context,
            max_num_batched_tokens=self.step_budget(device, context, step_tokens),
            speculative_config=speculative,
        )

    def check_complete(self) -> None:
        if None in (self.max_model_len, self.num_kv_blocks, self.max_num_batched_tokens):
            raise ValueError(
                "a Scheduler needs max_model_len, num_kv_blocks and max_num_batched_tokens "
                "set (resolved())"
            )


_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int, "float": (int, float), "str": str, "bool": bool, "dict[str, Any]": dict,
}  # fmt: skip


def check_knobs(config: Any) -> None:
    """Types, choices and bounds of every :func:`knob` field of a config dataclass;
    the message names the field."""
    for f in fields(config):
        meta = f.metadata
        if "doc" not in meta:
            continue
        value = getattr(config, f.name)
        if value is None and "None" in str(f.type):
            continue
        kind = str(f.type).removesuffix(" | None")
        wanted = _TYPES.get(kind)
        if wanted is not None:
            if isinstance(value, bool) and kind != "bool" or not isinstance(value, wanted):
                raise ValueError(f"{f.name} must be {kind}, got {value!r}")
        if meta.get("choices") is not None and value not in meta["choices"]:
            raise ValueError(f"{f.name} must be one of {', '.join(meta['choices'])}, got {value!r}")
        if meta.get("minimum") is not None and value < meta["minimum"]:
            raise ValueError(f"{f.name} must be >= {meta['minimum']}, got {value!r}")
        if meta.get("exclusive_minimum") is not None and not value > meta["exclusive_minimum"]:
            raise ValueError(f"{f.name} must be > {meta['exclusive_minimum']}, got {value!r}")
        if meta.get("maximum") is not None and value > meta["maximum"]:
            raise ValueError(f"{f.name} must be <= {meta['maximum']}, got {value!r}")
