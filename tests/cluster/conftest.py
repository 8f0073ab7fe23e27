"""Engines on the session's Ray instance, with the fake executor or a tiny checkpoint."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import pytest

from iterserve.cluster.config import EngineConfig
from iterserve.cluster.engine.api import AsyncEngine
from iterserve.scheduler import FakeModel, Request, SamplingParams, Scheduler
from tests.stand_ins import stand_in
from tests.workers.tiny_checkpoints import build_hf_model, save


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return str(save(build_hf_model("llama"), tmp_path_factory.mktemp("ckpt") / "llama"))


class FakeEngine(NamedTuple):
    """An engine config and the stand-in model its ranks run."""

    config: EngineConfig
    executor: FakeModel


def fake_config(executor: str = "fake", executor_options: dict | None = None, **overrides):
    """An engine of the fake model (or another stand-in, by name: tests/stand_ins.py)."""
    base = dict(
        num_kv_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        block_size=4,
        batch_timeout_s=0.05,
        batch_wait_s=0.01,
    )
    options = {
        "output_len": 6,
        "max_model_len": 128,
        "vocab_size": 1000,
        **(executor_options or {}),
    }
    return FakeEngine(EngineConfig.from_dict({**base, **overrides}), stand_in(executor, **options))


def model_config(path: str, **overrides) -> EngineConfig:
    base = dict(
        model=path,
        dtype="float32",
        num_kv_blocks=96,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        batch_timeout_s=0.05,
        batch_wait_s=0.01,
        num_cpus_per_worker=0.5,
        torch_threads=1,
    )
    base.update(overrides)
    return EngineConfig.from_dict(base)


async def start_engine(engine: EngineConfig | FakeEngine) -> AsyncEngine:
    if isinstance(engine, FakeEngine):
        return await AsyncEngine(engine.config, engine.executor).start()
    return await AsyncEngine(engine).start()


async def rank_pids(engine: AsyncEngine) -> list[int]:
    """The ranks' process ids, in rank order (where they run is the engine's to say)."""
    return [w["pid"] for w in await engine.actor.worker_nodes.remote()]


async def assert_sound(engine: AsyncEngine) -> dict:
    """Once idle, the engine holds no slot or block and its allocators passed the
    check it runs on itself whenever it goes idle (a failure would end it)."""
    stats = await wait_idle(engine)
    assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0, stats
    assert await engine.health() == (True, "ok")
    return stats


async def collect(engine: AsyncEngine, prompt, params: SamplingParams, **kw):
    tokens, reason = [], None
    async for out in engine.generate(prompt, params, **kw):
        tokens.extend(out.token_ids)
        reason = out.finish_reason
    return tokens, reason


async def collect_all(engine, prompts, params):
    return await asyncio.gather(*(collect(engine, p, params) for p in prompts))


async def wait_idle(engine: AsyncEngine, timeout_s: float = 5.0) -> dict:
    """Stats once nothing runs any more (an abort frees at the next step)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        stats = await engine.stats()
        if stats["slots_used"] == 0 and stats["num_running"] == 0 or loop.time() > deadline:
            return stats
        await asyncio.sleep(0.02)


PROMPTS = [[1 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate([3, 9, 17, 30, 5, 12])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def single_process(path: str, prompts, params, policy="chunked") -> list[list[int]]:
    """The reference: the same scheduler and runner in this process, no Ray."""
    from iterserve.workers.runner import ModelRunner

    config = model_config(path, policy=policy)
    sched = Scheduler(config.scheduler.resolved(num_kv_blocks=96, max_model_len=64, device="cpu"))
    runner = ModelRunner(
        path, dtype="float32", num_kv_blocks=96, block_size=4, kernel_backend="torch"
    )
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"r{i}", list(prompt), params))
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    while sched.has_work:
        step = sched.schedule(1e9)  # far future: static/dynamic launch at once
        for out in sched.update(runner.execute(step.plan)).outputs:
            outputs[out.request_id].extend(out.new_token_ids)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="session")
def reference(tiny_llama):
    return single_process(tiny_llama, PROMPTS, GREEDY)
