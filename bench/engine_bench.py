"""Engine benchmarks through Ray: control-plane overhead and the ceiling ratio.

- ``overhead``: ranks that run the fake model, whose step only sleeps 5 ms; what
  each step costs on top of that (schedule + broadcast + collect + update) is the
  control plane.
- ``ceiling``: the engine's decode throughput through Ray vs the same batch
  shapes replayed through the bare model runner in one process (no scheduler
  actor, no Ray, no serialization).

Both print figures; nothing here asserts on time.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path

import ray

from ..cluster.config import EngineConfig
from ..cluster.engine.api import AsyncEngine
from ..scheduler import FakeModel, Request, SamplingParams, Scheduler, SchedulerConfig
from ..scheduler.blocks import blocks_for
from .report import forward_ms_per_step


def ensure_ray() -> None:
    """A local Ray for the benchmarks, unless one is already running."""
    if not ray.is_initialized():
        # Ray starts its ranks at nice 15; on a shared machine that starves the engine
        # next to whatever the benchmark runs in this process at the default priority.
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(address="local", include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False, _node_ip_address="127.0.0.1")  # fmt: skip


async def _generate_all(engine: AsyncEngine, prompts: list[list[int]], params) -> dict:
    """Every prompt at once through a started engine; tokens and wall time."""

    async def one(prompt):
        n = 0
        async for out in engine.generate(prompt, params):
            n += len(out.token_ids)
        return n

    start = time.perf_counter()
    num_tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return {"num_tokens": num_tokens, "wall_s": time.perf_counter() - start}


async def _drive(
    config: EngineConfig, prompts: list[list[int]], params: SamplingParams, executor=None
) -> dict:
    engine = await AsyncEngine(config, executor).start()
    try:
        run = await _generate_all(engine, prompts, params)
        stats = await engine.stats()
    finally:
        await engine.shutdown()
    return {**run, "timing": stats["timing"]}


def control_ms_per_step(
    num_seqs: int,
    step_sleep_s: float = 0.005,
    max_tokens: int = 100,
    async_scheduling: bool = True,
) -> float:
    """Wall ms per step beyond the ranks' own time. With ``async_scheduling``,
    the part of the control plane that does not overlap the step before."""
    config = EngineConfig.from_dict(
        dict(
            async_scheduling=async_scheduling,
            num_kv_blocks=num_seqs * 16,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(512, num_seqs),
            num_cpus_per_worker=0.5,
        )
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    fake = FakeModel(output_len=None, max_model_len=512, step_sleep_s=step_sleep_s)
    prompts = [[3 + i % 50] * 16 for i in range(num_seqs)]
    run = asyncio.run(_drive(config, prompts, params, fake))
    timing = run["timing"]
    return (timing["step_s"] - timing["forward_s"]) / timing["steps"] * 1000.0


def overhead() -> dict:
    """Control-plane ms per step at 8 and 64 sequences: ``control_*`` with the
    default configuration (each plan built while the step before runs),
    ``one_at_a_time_*`` the same with ``async_scheduling`` off."""
    ensure_ray()
    variants = (("control", True), ("one_at_a_time", False))
    return {
        f"{key}_ms_per_step_{n}": round(control_ms_per_step(n, async_scheduling=ahead), 3)
        for key, ahead in variants
        for n in (8, 64)
    }


class _CeilingRun:
    """One engine, its one-step-at-a-time twin, and the bare runner, on the same
    prompts: ``alternate`` times them in turn."""

    def __init__(
        self, model: str, num_seqs: int, prompt_len: int, max_tokens: int, torch_threads: int
    ):
        import torch

        from ..workers.runner import ModelRunner

        block_size = SchedulerConfig().block_size
        # Every sequence's prompt and output fit, plus a block: nothing is ever preempted.
        self.num_kv_blocks = num_seqs * (blocks_for(prompt_len + max_tokens, block_size) + 1)
        self.config = EngineConfig.from_dict(dict(
            model=model,
            dtype="float32",
            kernel_backend="torch",
            num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(256, num_seqs * prompt_len),
            max_model_len=512,
            torch_threads=torch_threads,
            num_cpus_per_worker=1.0,
        ))  # fmt: skip
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.prompts = [
            [10 + (i * 7 + j) % 300 for j in range(prompt_len)] for i in range(num_seqs)
        ]
        torch.set_num_threads(torch_threads)
        self.runner = ModelRunner(
            model,
            dtype="float32",
            num_kv_blocks=self.num_kv_blocks,
            block_size=block_size,
            kernel_backend="torch",
        )

    def bare_pass(self) -> tuple[float, float]:
        """The same scheduler decisions replayed in-process: only the runner is timed.
        Returns tokens/s and the model forward's ms per step."""
        config = self.config.scheduler.resolved(
            num_kv_blocks=self.num_kv_blocks, max_model_len=512, device="cpu"
        )
        sched = Scheduler(config, kv_window=self.runner.config.kv_window)
        for i, prompt in enumerate(self.prompts):
            sched.add_request(Request(f"r{i}", prompt, self.params))
        bare_s, forward_s, steps, num_tokens = 0.0, 0.0, 0, 0
        while sched.has_work:
            step = sched.schedule(time.monotonic())
            start = time.perf_counter()
            result = self.runner.execute(step.plan)
            bare_s += time.perf_counter() - start
            forward_s += result.forward_s
            steps += 1
            num_tokens += len(result.sampled)
            sched.update(result)
        return num_tokens / bare_s, 1000 * forward_s / steps

    async def engine_pass(self, engine: AsyncEngine) -> tuple[float, float]:
        """Tokens/s through the engine, and the rank's forward ms per step."""
        before = (await engine.stats())["timing"]
        run = await _generate_all(engine, self.prompts, self.params)
        after = (await engine.stats())["timing"]
        return run["num_tokens"] / run["wall_s"], forward_ms_per_step(before, after)

    async def alternate(self, rounds: int) -> dict[str, list[float]]:
        engine = await AsyncEngine(self.config).start()
        serial = await AsyncEngine(self.config.replace(async_scheduling=False)).start()
        runs: dict[str, list[float]] = {
            key: [] for key in ("engine", "serial", "bare", "engine_fwd", "bare_fwd")
        }
        try:
            for warm in (engine, serial):
                await _generate_all(warm, self.prompts[:1], self.params)  # one-off costs
            self.bare_pass()
            for _ in range(rounds):
                tok_s, fwd_ms = await self.engine_pass(engine)
                runs["engine"].append(tok_s)
                runs["engine_fwd"].append(fwd_ms)
                runs["serial"].append((await self.engine_pass(serial))[0])
                tok_s, fwd_ms = self.bare_pass()
                runs["bare"].append(tok_s)
                runs["bare_fwd"].append(fwd_ms)
        finally:
            await engine.shutdown()
            await serial.shutdown()
        return runs


def _default_model() -> str:
    from ..models import DEMO_MODEL_PATH

    if not (Path(DEMO_MODEL_PATH) / "config.json").exists():
        raise SystemExit(f"no checkpoint at {DEMO_MODEL_PATH}; pass --model")
    return str(DEMO_MODEL_PATH)


def ceiling(
    model: str | None = None,
    num_seqs: int = 16,
    prompt_len: int = 32,
    max_tokens: int = 128,
    torch_threads: int = 1,
    rounds: int = 5,
) -> dict:
    """Engine tokens/s through Ray ÷ the same plans through the bare runner.

    This machine's forward speed drifts by 10-20% from one second to the next, more
    than the gap being measured, so the two are measured in ``rounds`` alternating
    passes (engine, bare, engine, bare, ...) and the medians are compared. Each round
    also runs a second engine with ``async_scheduling`` off (``engine_serial_*``):
    what building each plan while the step before runs is worth."""
    model = model or _default_model()
    ensure_ray()
    run = _CeilingRun(model, num_seqs, prompt_len, max_tokens, torch_threads)
    runs = asyncio.run(run.alternate(rounds))
    engine_tok_s = statistics.median(runs["engine"])
    serial_tok_s = statistics.median(runs["serial"])
    ceiling_tok_s = statistics.median(runs["bare"])
    return {
        "model": model,
        "num_seqs": num_seqs,
        "max_tokens": max_tokens,
        "engine_tok_s": round(engine_tok_s, 2),
        "ceiling_tok_s": round(ceiling_tok_s, 2),
        "ratio": round(engine_tok_s / ceiling_tok_s, 3),
        "engine_serial_tok_s": round(serial_tok_s, 2),
        "engine_serial_ratio": round(serial_tok_s / ceiling_tok_s, 3),
        # The model forward alone, per step, in the rank and in this process: how much
        # of the gap is the forward itself running slower next to the other processes.
        "engine_forward_ms": round(statistics.median(runs["engine_fwd"]), 3),
        "bare_forward_ms": round(statistics.median(runs["bare_fwd"]), 3),
        "engine_tok_s_runs": [round(x, 1) for x in runs["engine"]],
        "engine_serial_tok_s_runs": [round(x, 1) for x in runs["serial"]],
        "ceiling_tok_s_runs": [round(x, 1) for x in runs["bare"]],
    }
