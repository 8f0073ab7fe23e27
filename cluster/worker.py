"""The worker actor: one per tensor-parallel rank, one executor each.

Between steps a worker only ever receives encoded :class:`StepPlan` bytes and
answers encoded :class:`StepResult` bytes (rank 0 only; other ranks answer
``b""``), through the transport :mod:`worker_group` chose.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
from typing import Any

from iterserve.cluster.config import EngineConfig
from iterserve.cluster.gc_pauses import freeze_startup_objects
from iterserve.scheduler import codec
from iterserve.scheduler.messages import StepPlan, StepResult
from iterserve.workers.host_memory import keep_freed_memory

logger = logging.getLogger(__name__)
PING_STEP = -1  # a plan with this step number only checks that the workers answer
CPU_KV_CACHE_MAX_BYTES = 1 << 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _all_reduce(tensor):
    import torch.distributed as dist

    dist.all_reduce(tensor)  # in place: sums the ranks' partial outputs
    return tensor


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


class EngineWorker:
    def __init__(self, config: EngineConfig, rank: int):
        self.config = config
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.executor: Any = None
        self.all_reduce = None
        self.endpoint = None  # the step channel's rank end, once opened
        niceness = os.nice(0)
        if niceness > 0:
            logger.warning(
                "rank %d runs at nice %d: any process at nice 0 on this node takes the CPU "
                "from it first; start Ray with RAY_worker_niceness=0",
                rank,
                niceness,
            )
        keep_freed_memory()
        if config.torch_threads:
            import torch

            torch.set_num_threads(config.torch_threads)

    # -- start-up (plain calls, once) ---------------------------------------------

    def pid(self) -> int:
        return os.getpid()

    def placement(self) -> dict:
        import ray

        context = ray.get_runtime_context()
        return {
            "NodeID": context.get_node_id(),
            "pid": os.getpid(),
            "placement_group": context.get_placement_group_id(),
        }

    def address(self) -> tuple[str, int]:
        """Rank 0's rendezvous address for torch.distributed."""
        import ray

        return (ray.util.get_node_ip_address(), _free_port())

    def init_distributed(self, host: str, port: int) -> None:
        if self.world_size == 1:
            return
        import torch
        import torch.distributed as dist

        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world_size
        )
        if backend == "nccl":
            torch.cuda.set_device(0)
        self.all_reduce = _all_reduce

    @property
    def device(self) -> str:
        if self.config.device != "auto":
            return self.config.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def model_info(self) -> dict:
        """Facts the scheduler needs (context length, vocabulary, the rank's device,
        the window every layer reads within: None when a layer reads everything),
        and the dtype the rank computes in, with why."""
        if self.config.executor != "model":
            opts = self.config.executor_options
            return {
                "max_model_len": opts.get("max_model_len", 2048),
                "vocab_size": opts.get("vocab_size", 32000),
                "device": self.device,
            }
        from iterserve.workers.checkpoint import load_checkpoint
        from iterserve.workers.dtype import choose_dtype

        ckpt = load_checkpoint(self.config.model_path)
        choice = choose_dtype(
            self.config.dtype, ckpt.config.torch_dtype, self.device, self.config.kernel_backend
        )
        info = {
            "max_model_len": ckpt.config.max_model_len,
            "vocab_size": ckpt.config.vocab_size,
            "device": self.device,
            "dtype": choice.name,
            "dtype_reason": choice.reason,
            "kv_window": ckpt.config.kv_window,  # blocks before it are handed on
        }
        ckpt.close()
        return info

    def kv_capacity(self) -> int:
        """KV blocks this rank can hold within ``kv_memory_fraction`` of free memory.

        Free memory is read before the weights load, so on a GPU the budget is
        also capped by what the weights and the largest step's activations leave.
        """
        if self.config.scheduler.num_kv_blocks is not None:
            return self.config.scheduler.num_kv_blocks
        if self.config.executor != "model":
            return 4096
        from iterserve.workers.checkpoint import load_checkpoint, resolve_dtype
        from iterserve.workers.kv_cache import blocks_for_budget, kv_budget_bytes, workspace_bytes
        from iterserve.workers.model import weight_bytes

        ckpt = load_checkpoint(self.config.model_path)
        c = ckpt.config
        dtype = resolve_dtype(self.config.dtype, c, self.device, self.config.kernel_backend)
        ckpt.close()
        free = _available_memory_bytes(self.device)
        kv_heads = max(1, c.num_kv_heads // self.world_size)
        if self.device.startswith("cuda"):
            heads = c.num_heads // self.world_size
            workspace = workspace_bytes(
                hidden_size=c.hidden_size,
                intermediate_size=c.intermediate_size // self.world_size,
                q_size=heads * c.head_dim,
                kv_size=kv_heads * c.head_dim,
                vocab_size=c.vocab_size,
                # The budget the engine will derive, with the context it will pick.
                max_num_batched_tokens=self.config.scheduler.step_budget(
                    self.device, self.config.scheduler.context_for(c.max_model_len)
                ),
                max_num_seqs=self.config.scheduler.max_num_seqs,
                dtype=dtype,
            )
            weights = weight_bytes(c, dtype, self.rank, self.world_size)
            budget = kv_budget_bytes(free, weights, workspace, self.config.kv_memory_fraction)
        else:
            # Host memory is shared with everything else on the machine: cap the cache.
            budget = min(int(free * self.config.kv_memory_fraction), CPU_KV_CACHE_MAX_BYTES)
        return blocks_for_budget(
            budget, c.num_layers, self.config.scheduler.block_size, kv_heads, c.head_dim, dtype
        )

    def load(self, num_kv_blocks: int) -> None:
        """Builds the executor with the KV cache size every rank agreed on."""
        kind = self.config.executor
        if kind == "model":
            from iterserve.workers.graphs import graph_buckets
            from iterserve.workers.runner import ModelRunner

            self.executor = ModelRunner(
                self.config.model_path,
                dtype=self.config.dtype,
                num_kv_blocks=num_kv_blocks,
                block_size=self.config.scheduler.block_size,
                device=self.device,
                tp_rank=self.rank,
                tp_size=self.world_size,
                all_reduce=self.all_reduce,
                kernel_backend=self.config.kernel_backend,
                # Decode graphs for every batch the scheduler can run, over the
                # longest context it allows (the checkpoint's, when it leaves it).
                graph_batch_sizes=graph_buckets(self.config.scheduler.max_num_seqs),
                max_model_len=self.config.scheduler.max_model_len,
                max_loras=self.config.rank_max_loras,
                max_lora_rank=self.config.max_lora_rank,
                max_cpu_loras=self.config.max_cpu_loras,
            )
            self.executor.warm_up()  # compiled kernels built before the engine reports ready
        elif kind == "fake":
            from iterserve.scheduler.fake_executor import FakeExecutor

            opts = dict(self.config.executor_options)
            opts.pop("max_model_len", None)
            self.executor = FakeExecutor(block_size=self.config.scheduler.block_size, **opts)
        else:
            module, _, attr = kind.partition(":")
            factory = getattr(importlib.import_module(module), attr)
            self.executor = factory(self.config, self.rank, self.world_size, self.all_reduce)
        freeze_startup_objects()

    def open_step_channel(self, token: bytes, local: bool) -> tuple:
        """Listens for the scheduler's step channel (see :mod:`step_channel`); returns
        the address to connect to: a Unix socket path when ``local``, else TCP."""
        import ray

        from iterserve.cluster.step_channel import RankEndpoint

        self.endpoint = RankEndpoint(self.execute, token, local, ray.util.get_node_ip_address())
        return self.endpoint.address

    # -- the step (through the step channel or the compiled graph) --------------------

    def execute(self, plan_bytes: bytes) -> bytes:
        plan = codec.decode(plan_bytes, StepPlan)
        if plan.step == PING_STEP:
            return codec.encode(StepResult(step=PING_STEP))
        result = self.executor.execute(plan)
        return codec.encode(result) if self.rank == 0 else b""
