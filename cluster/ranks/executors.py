"""What runs a rank's steps: the checkpoint's model, unless code hands the engine
something else.

An engine builds one executor per rank (``execute(plan) -> result``) through an
:class:`ExecutorFactory`. The factory is an object given in Python
(``AsyncEngine(config, executor=...)``, ``build_application(args, executor)``), never
a configuration key: a deployment config is data and cannot name code, so the
stand-ins that tests and control-plane benchmarks run
(:class:`~iterserve.scheduler.fake_executor.FakeModel`) are out of its reach.
The factory crosses to the ranks through Ray, so it is a small picklable object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ...scheduler.messages import StepPlan, StepResult
    from ..config import EngineConfig

CPU_KV_CACHE_MAX_BYTES = 1 << 30


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


class ExecutorFactory(Protocol):
    def model_info(self, config: EngineConfig, device: str, level: str | None = None) -> dict:
        """``{"max_model_len", "vocab_size"}`` of what the executors run on ``device``;
        optionally ``kv_window`` (the window every layer reads within; None when a layer
        reads everything), ``hidden_size`` (a pooling runner's vectors' length),
        ``dtype``, ``dtype_reason`` (what the ranks compute in, why), ``quantization``
        (the weights' scheme, None: dense) and ``runtime``:
        the engine's choices that change numerics, made here once (on the first rank,
        at the engine's instruction-set ``level``) and handed to every rank's
        :meth:`kv_capacity` and :meth:`build`."""

    def kv_capacity(self, config: EngineConfig, rank: int, world_size: int, device: str,
                    runtime: dict | None = None) -> int:  # fmt: skip
        """KV blocks one rank can hold, when the config does not say."""

    def build(
        self, config: EngineConfig, rank: int, world_size: int, device: str, all_reduce: Any,
        runtime: dict | None = None,
    ) -> Executor:  # fmt: skip
        """One rank's executor, with ``config.scheduler.num_kv_blocks`` agreed on."""


def _available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info()
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def _draft_path(config: EngineConfig) -> str | None:
    """The draft model's checkpoint, when speculation proposes with one."""
    spec = config.scheduler.speculative_config
    return spec.get("model") if spec.get("method") == "draft_model" else None


# A prefill step of 512 tokens of a 144M-parameter Llama costs ~150 ms on one core.
# A smaller model's steps of 512 tokens are short enough that what every step costs
# besides its tokens (the plan, the broadcast, the scheduler's update) decides its
# prefill: the demo model (3M parameters a token) at 64 x (1000 / 192), 2048-token
# steps against 512: TTFT p50 0.72x, output 1.15x; 4096 took no less time to the
# first token than 2048. So on a CPU a model gets about the 144M model's 512
# tokens' cost a step, in whole 512s, up to 2048 tokens.
CPU_STEP_COST = 512 * 144_000_000
CPU_STEP_TOKENS_MAX = 2048


def cpu_step_tokens(config) -> int:
    """The step budget a CPU rank's model gets when the config does not set one."""
    c, hd = config, config.head_dim
    attention = (2 * c.num_heads + 2 * c.num_kv_heads) * hd * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    if c.experts is not None:
        mlp = max(mlp, 3 * c.hidden_size * c.experts.intermediate_size * c.experts.top_k)
    per_token = c.num_layers * (attention + mlp) + c.vocab_size * c.hidden_size
    tokens = CPU_STEP_COST // max(per_token, 1) // 512 * 512
    return int(min(max(tokens, 512), CPU_STEP_TOKENS_MAX))


def _isa_phrase(device: str) -> str:
    """The CPU's instruction-set level as the kernels use it (and what capped it)."""
    from ...kernels.cpu import isa

    return isa.describe() if device.startswith("cpu") else f"{isa.describe()} (host CPU)"


def _kernels(config, choices, device: str, kernel_backend: str, quantized=()) -> dict[str, str]:
    """The CPU kernel each op runs for this model at the engine's level and dtype
    (``/version`` shows them), ``quantized`` products' ops among them; nothing on
    another device or backend."""
    if not device.startswith("cpu") or kernel_backend not in ("auto", "cpu"):
        return {}
    from ...kernels.cpu import dispatch

    traits = dispatch.model_traits(config.num_heads, config.num_kv_heads, config.head_dim,
                                   config.hidden_size, invariant=choices.batch_invariant)  # fmt: skip
    traits.update({op: frozenset() for op in quantized})
    kernels = dispatch.Dispatch(choices.isa).describe(choices.dtype, traits)
    if choices.batch_invariant:  # every piece is the row kernels'
        kernels["attention.long"] = "none (batch-invariant: every piece on attention.rows)"
    return kernels


class ModelExecutors:
    """The checkpoint of ``config.model_path``, a :class:`ModelRunner` per rank."""

    def model_info(self, config: EngineConfig, device: str, level: str | None = None) -> dict:
        from ...workers import quant
        from ...workers.checkpoint import load_checkpoint
        from ...workers.dtype import decide

        draft = _draft_path(config)
        if draft is not None:
            from ...workers.draft import check_draft

            check_draft(draft, config.model_path)  # a ValueError naming the problem
        ckpt = load_checkpoint(config.model_path)
        quantized = quant.resolve(config.quantization, ckpt.quantization)  # refused by name
        choices = decide(ckpt.config, config.dtype, ckpt.config.torch_dtype, device,
                         config.kernel_backend, level=level,
                         tp_size=config.tensor_parallel_size,
                         batch_invariant=config.batch_invariant, quantized=quantized)  # fmt: skip
        info = {
            "max_model_len": ckpt.config.max_model_len,
            "vocab_size": ckpt.config.vocab_size,
            "hidden_size": ckpt.config.hidden_size,  # a pooling runner's vectors' length
            "dtype": choices.dtype,
            "dtype_reason": choices.dtype_reason,
            "kv_window": ckpt.config.kv_window,  # blocks before it are handed on
            "runtime": choices.to_dict(),
            "step_tokens": cpu_step_tokens(ckpt.config) if device.startswith("cpu") else None,
            "batch_invariant": choices.batch_invariant,
            "isa": _isa_phrase(device),
            "kernels": _kernels(
                ckpt.config, choices, device, config.kernel_backend, quant.ops(quantized)
            ),
            "quantization": quant.describe(quantized, device),
        }
        ckpt.close()
        return info

    def kv_capacity(self, config: EngineConfig, rank: int, world_size: int, device: str,
                    runtime: dict | None = None) -> int:  # fmt: skip
        """KV blocks this rank can hold within ``kv_memory_fraction`` of free memory.

        Free memory is read before the weights load, so on a GPU the budget is
        also capped by what the weights and the largest step's activations leave.
        """
        from ...workers.checkpoint import load_checkpoint
        from ...workers.dtype import RuntimeChoices, choose_dtype
        from ...workers.kv_cache import blocks_for_budget, kv_budget_bytes, workspace_bytes
        from ...workers.model import weight_bytes

        ckpt = load_checkpoint(config.model_path)
        c = ckpt.config
        if runtime is not None:
            dtype = RuntimeChoices.from_dict(runtime).torch_dtype
        else:  # a rank on its own, as a test builds one
            dtype = choose_dtype(config.dtype, c.torch_dtype, device, config.kernel_backend).dtype
        ckpt.close()
        free = _available_memory_bytes(device)
        kv_heads = max(1, c.num_kv_heads // world_size)
        if device.startswith("cuda"):
            heads = c.num_heads // world_size
            workspace = workspace_bytes(
                hidden_size=c.hidden_size,
                intermediate_size=c.intermediate_size // world_size,
                q_size=heads * c.head_dim,
                kv_size=kv_heads * c.head_dim,
                vocab_size=c.vocab_size,
                # The budget the engine will derive, with the context it will pick.
                max_num_batched_tokens=config.scheduler.step_budget(
                    device, config.scheduler.context_for(c.max_model_len)
                ),
                max_num_seqs=config.scheduler.max_num_seqs,
                dtype=dtype,
            )
            weights = weight_bytes(c, dtype, rank, world_size)
            budget = kv_budget_bytes(free, weights, workspace, config.kv_memory_fraction)
        else:
            # Host memory is shared with everything else on the machine: cap the cache.
            budget = min(int(free * config.kv_memory_fraction), CPU_KV_CACHE_MAX_BYTES)
        blocks = blocks_for_budget(
            budget, c.num_layers, config.scheduler.block_size, kv_heads, c.head_dim, dtype
        )
        draft = _draft_path(config)
        if draft is not None:  # a draft model's cache has as many blocks: share the budget
            from ...workers.draft import draft_block_bytes
            from ...workers.kv_cache import bytes_per_block

            size = config.scheduler.block_size
            mine = bytes_per_block(c.num_layers, size, kv_heads, c.head_dim, dtype)
            blocks = blocks * mine // (mine + draft_block_bytes(draft, size, dtype))
        return blocks

    def build(
        self, config: EngineConfig, rank: int, world_size: int, device: str, all_reduce: Any,
        runtime: dict | None = None,
    ) -> Executor:  # fmt: skip
        from ...workers.checkpoint import load_checkpoint
        from ...workers.dtype import RuntimeChoices
        from ...workers.graphs import graph_buckets
        from ...workers.runner import ModelRunner

        # The context the engine serves, resolved as the engine resolves it from
        # model_info (the configured one, else the checkpoint's up to CONTEXT_CAP):
        # it picks a longrope model's factors, alike on every rank and in the draft.
        ckpt = load_checkpoint(config.model_path)
        max_model_len = config.scheduler.context_for(ckpt.config.max_model_len)
        ckpt.close()
        runner = ModelRunner(
            config.model_path,
            dtype=config.dtype,
            choices=None if runtime is None else RuntimeChoices.from_dict(runtime),
            num_kv_blocks=config.scheduler.num_kv_blocks,
            block_size=config.scheduler.block_size,
            device=device,
            tp_rank=rank,
            tp_size=world_size,
            all_reduce=all_reduce,
            kernel_backend=config.kernel_backend,
            # Decode graphs for every batch the scheduler can run, over the
            # longest context it allows.
            graph_batch_sizes=graph_buckets(config.scheduler.max_num_seqs),
            max_model_len=max_model_len,
            max_loras=config.rank_max_loras,
            max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras,
            draft_model=_draft_path(config),
            pooling=config.pooling_type if config.runner == "pooling" else None,
            seed=config.seed,
            quantization=config.quantization,
        )
        runner.warm_up()  # compiled kernels built before the engine reports ready
        from ...workers.kv_tiers import with_kv_tiers

        return with_kv_tiers(runner, config, rank, world_size, runtime)
