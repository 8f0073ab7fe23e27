"""Entry point of one tensor-parallel rank in the TP test (run under mp.spawn)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def run_rank(rank: int, world: int, port: int, model_path: str, prompts, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        from plan_driver import PlanDriver

        from iterserve.scheduler.sampling import SamplingParams
        from iterserve.workers import ModelRunner

        runner = ModelRunner(
            model_path,
            num_kv_blocks=128,
            block_size=8,
            kernel_backend="torch",
            tp_rank=rank,
            tp_size=world,
            all_reduce=all_reduce,
        )
        driver = PlanDriver(runner)
        for i, p in enumerate(prompts):
            driver.add(f"g{i}", p)
        seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
        driver.add("seeded", prompts[0], seeded)
        out = driver.run(chunk=7)
        with open(f"{out_file}.{rank}", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()
