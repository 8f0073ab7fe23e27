"""Entry point of one tensor-parallel rank in the TP test (run under mp.spawn)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def run_rank(rank: int, world: int, port: int, model_path: str, prompts, out_file: str,
             max_model_len: int | None = None) -> None:  # fmt: skip
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
            max_model_len=max_model_len,
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


def run_logits_rank(rank: int, world: int, port: int, model_path: str, prompts,
                    out_file: str) -> None:  # fmt: skip
    """Every row's fp32 logits of each prompt prefilled whole, at TP=``world``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        from test_model_logits import forward_all_rows

        from iterserve.workers import ModelRunner

        runner = ModelRunner(model_path, num_kv_blocks=64, block_size=8, dtype="float32",
                             kernel_backend="torch", tp_rank=rank, tp_size=world,
                             all_reduce=all_reduce)  # fmt: skip
        logits = forward_all_rows(runner, [[(0, len(p))] for p in prompts], prompts)
        torch.save(logits, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


def run_constrained_rank(rank: int, world: int, port: int, model_path: str, out_file: str) -> None:
    """The demo model at TP=``world`` with grammars: each rank writes its tokens and
    whether it returned prompt logprobs."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        from plan_driver import PlanDriver

        from iterserve.workers import ModelRunner

        runner = ModelRunner(model_path, num_kv_blocks=128, block_size=8, kernel_backend="torch",
                             tp_rank=rank, tp_size=world, all_reduce=all_reduce)  # fmt: skip
        driver = PlanDriver(runner)
        for name, prompt, params in constrained_requests(model_path):
            driver.add(name, prompt, params)
        out = driver.run(chunk=5)
        prompt_logprobs = sum(len(r.prompt_logprobs) for r in driver.results)
        with open(f"{out_file}.{rank}", "w") as f:
            json.dump({"tokens": out, "prompt_logprobs": prompt_logprobs}, f)
    finally:
        dist.destroy_process_group()


def constrained_requests(model_path: str) -> list:
    from iterserve.scheduler.sampling import SamplingParams, StructuredOutput
    from iterserve.workers.tokenizer import Tokenizer

    tok = Tokenizer(model_path)
    prompt = tok.encode("A record of the release:")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
              "year": {"type": "integer", "minimum": 1990, "maximum": 2030}},
              "required": ["name", "year"]}  # fmt: skip
    grammar = StructuredOutput("json", json.dumps(schema))
    return [
        (
            "greedy",
            prompt,
            SamplingParams(
                temperature=0.0, max_tokens=60, structured_output=grammar, prompt_logprobs=2
            ),
        ),  # fmt: skip
        (
            "sampled",
            prompt,
            SamplingParams(temperature=1.0, seed=5, max_tokens=60, structured_output=grammar),
        ),  # fmt: skip
        ("free", prompt, SamplingParams(temperature=1.0, seed=6, max_tokens=12, ignore_eos=True)),
    ]
