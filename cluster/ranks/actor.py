"""The rank actor: one per tensor-parallel rank, one executor each.

Between steps a rank only ever receives encoded :class:`StepPlan` bytes and
answers encoded :class:`StepResult` bytes (rank 0 only; other ranks answer
``b""``), through the step channel (:mod:`~iterserve.cluster.ranks.step_channel`). What executes the
steps is the model, or what the engine's :mod:`~iterserve.cluster.ranks.executors` factory builds.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from ...scheduler import codec
from ...scheduler.messages import StepPlan, StepResult
from ...workers.host_memory import keep_freed_memory
from ..config import EngineConfig
from ..gc_pauses import freeze_startup_objects
from .executors import ExecutorFactory, ModelExecutors

logger = logging.getLogger(__name__)
PING_STEP = -1  # a plan with this step number only checks that the ranks answer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _all_reduce(tensor):
    import torch.distributed as dist

    dist.all_reduce(tensor)  # in place: sums the ranks' partial outputs
    return tensor


class RankActor:
    """``executors``: what builds this rank's executor (None: the model)."""

    def __init__(self, config: EngineConfig, rank: int, executors: ExecutorFactory | None = None):
        self.config = config
        self.rank = rank
        self.executors: ExecutorFactory = executors or ModelExecutors()
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

    def cpu_isa(self) -> str:
        """The instruction-set level this rank's CPU kernels could use (its hardware's,
        at most ``ITERSERVE_CPU_ISA``); the engine runs every rank at the lowest."""
        from ...kernels.cpu import isa

        return isa.level()

    def model_info(self, levels: list[str] | None = None) -> dict:
        """Facts the scheduler needs (context length, vocabulary, the rank's device,
        the window every layer reads within), and the engine's choices that change
        numerics (``runtime``: the dtype, with why, ...), made here, on the first
        rank, at the lowest of the ranks' instruction-set ``levels``."""
        level = None
        if levels:
            from ...kernels.cpu import isa

            level = isa.lowest(levels)
        self._cap(level)
        info = self.executors.model_info(self.config, self.device, level)
        return {**info, "device": self.device}

    def kv_capacity(self, runtime: dict | None = None) -> int:
        """KV blocks this rank can hold (the configured number, when set)."""
        if self.config.scheduler.num_kv_blocks is not None:
            return self.config.scheduler.num_kv_blocks
        return self.executors.kv_capacity(
            self.config, self.rank, self.world_size, self.device, runtime
        )

    def load(self, num_kv_blocks: int, runtime: dict | None = None) -> dict | None:
        """Builds the executor with the KV cache size every rank agreed on and the
        engine's ``runtime`` choices (as rank 0's :meth:`model_info` made them).
        Returns what the engine needs of its KV tiers (None: it has none)."""
        self._cap(runtime and runtime.get("isa"))
        config = self.config.replace(num_kv_blocks=num_kv_blocks)
        self.executor = self.executors.build(
            config, self.rank, self.world_size, self.device, self.all_reduce, runtime
        )
        freeze_startup_objects()
        info = getattr(self.executor, "kv_tier_info", None)
        return info() if info is not None else None

    @staticmethod
    def _cap(level: str | None) -> None:
        """Runs this rank's CPU kernels at the engine's ``level`` (before any compiles)."""
        if level is not None:
            from ...kernels.cpu import isa

            isa.cap(level)

    def open_step_channel(self, token: bytes, local: bool) -> tuple:
        """Listens for the scheduler's step channel (see :mod:`~iterserve.cluster.ranks.step_channel`); returns
        the address to connect to: a Unix socket path when ``local``, else TCP."""
        import ray

        from .step_channel import RankEndpoint

        self.endpoint = RankEndpoint(self.execute, token, local, ray.util.get_node_ip_address())
        return self.endpoint.address

    # -- the step (through the step channel or the compiled graph) --------------------

    def execute(self, plan_bytes: bytes) -> bytes:
        plan = codec.decode(plan_bytes, StepPlan)
        if plan.step == PING_STEP:
            return codec.encode(StepResult(step=PING_STEP))
        result = self.executor.execute(plan)
        if self.rank == 0:
            return codec.encode(result)
        # The others' results are not read, but for their KV tiers' reports.
        return b"" if result.kv is None else codec.encode(StepResult(plan.step, kv=result.kv))
