"""Engine benchmarks through Ray: control-plane overhead and the ceiling ratio.

- ``overhead``: workers whose forward only sleeps 5 ms; what each step costs on
  top of that (schedule + broadcast + collect + update) is the control plane.
- ``ceiling``: the engine's decode throughput through Ray vs the same batch
  shapes replayed through the bare model runner in one process (no scheduler
  actor, no Ray, no serialization).

Both print figures; nothing here asserts on time.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import ray

from iterserve.cluster.config import EngineConfig
from iterserve.cluster.engine import AsyncEngine
from iterserve.scheduler import Request, SamplingParams, Scheduler


def ensure_ray() -> None:
    """A local Ray for the benchmarks, unless one is already running."""
    if not ray.is_initialized():
        # Ray starts its workers at nice 15; on a shared machine that starves the engine
        # next to whatever the benchmark runs in this process at the default priority.
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False, _node_ip_address="127.0.0.1")  # fmt: skip


async def _drive(config: EngineConfig, prompts: list[list[int]], params: SamplingParams) -> dict:
    engine = await AsyncEngine(config).start()
    try:

        async def one(prompt):
            n = 0
            async for out in engine.generate(prompt, params):
                n += len(out.token_ids)
            return n

        start = time.perf_counter()
        num_tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        wall_s = time.perf_counter() - start
        stats = await engine.stats()
    finally:
        await engine.shutdown()
    return {"num_tokens": num_tokens, "wall_s": wall_s, "timing": stats["timing"]}


def control_ms_per_step(
    num_seqs: int,
    step_sleep_s: float = 0.005,
    max_tokens: int = 100,
    step_transport: str = "auto",
) -> float:
    config = EngineConfig(
        step_transport=step_transport,
        executor="fake",
        executor_options={"output_len": None, "max_model_len": 512, "step_sleep_s": step_sleep_s},
        num_kv_blocks=num_seqs * 16,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(512, num_seqs),
        num_cpus_per_worker=0.5,
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    run = asyncio.run(_drive(config, [[3 + i % 50] * 16 for i in range(num_seqs)], params))
    timing = run["timing"]
    return (timing["step_s"] - timing["forward_s"]) / timing["steps"] * 1000.0


def overhead() -> dict:
    """Control-plane ms per step at 8 and 64 sequences: ``control_*`` through the
    default transport (the step channel), then the other two for comparison."""
    ensure_ray()
    transports = (("control", "auto"), ("compiled_graph", "compiled_graph"),
                  ("actor_calls", "actor_calls"))  # fmt: skip
    return {
        f"{key}_ms_per_step_{n}": round(control_ms_per_step(n, step_transport=transport), 3)
        for key, transport in transports
        for n in (8, 64)
    }


def _default_model() -> str:
    from iterserve.models import DEMO_MODEL_PATH

    if not (Path(DEMO_MODEL_PATH) / "config.json").exists():
        raise SystemExit(f"no checkpoint at {DEMO_MODEL_PATH}; pass --model")
    return str(DEMO_MODEL_PATH)


def ceiling(
    model: str | None = None,
    num_seqs: int = 16,
    prompt_len: int = 32,
    max_tokens: int = 64,
    torch_threads: int = 1,
) -> dict:
    """Engine tokens/s through Ray ÷ the same plans through the bare runner."""
    import torch

    from iterserve.workers.runner import ModelRunner

    model = model or _default_model()
    ensure_ray()
    config = EngineConfig(
        model=model,
        dtype="float32",
        kernel_backend="torch",
        num_kv_blocks=num_seqs * 16,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(256, num_seqs * prompt_len),
        max_model_len=512,
        torch_threads=torch_threads,
        num_cpus_per_worker=1.0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [[10 + (i * 7 + j) % 300 for j in range(prompt_len)] for i in range(num_seqs)]
    engine_run = asyncio.run(_drive(config, prompts, params))

    # The same scheduler decisions replayed in-process: only the runner is timed.
    torch.set_num_threads(torch_threads)
    sched = Scheduler(config.scheduler_config(num_kv_blocks=num_seqs * 16, max_model_len=512))
    runner = ModelRunner(
        model,
        dtype="float32",
        num_kv_blocks=num_seqs * 16,
        block_size=config.block_size,
        kernel_backend="torch",
    )
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"r{i}", prompt, params))
    bare_s, num_tokens = 0.0, 0
    while sched.has_work:
        plan = sched.schedule(time.monotonic())
        start = time.perf_counter()
        result = runner.execute(plan)
        bare_s += time.perf_counter() - start
        num_tokens += len(result.sampled)
        sched.update(result)
    engine_tok_s = engine_run["num_tokens"] / engine_run["wall_s"]
    ceiling_tok_s = num_tokens / bare_s
    return {
        "model": model,
        "num_seqs": num_seqs,
        "engine_tok_s": round(engine_tok_s, 2),
        "ceiling_tok_s": round(ceiling_tok_s, 2),
        "ratio": round(engine_tok_s / ceiling_tok_s, 3),
    }
