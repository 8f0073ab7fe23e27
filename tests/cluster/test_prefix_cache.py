"""Prefix caching on the real model: greedy outputs token for token as without it."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal

import pytest
import torch

from iterserve.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from tests.cluster.conftest import (
    assert_sound,
    collect_all,
    model_config,
    rank_pids,
    start_engine,
    wait_idle,
)
from tests.scheduler.driver import Arrival, arrival_prompt, prompt_for, run

HANG_GUARD_S = 120
SYSTEM_LENS = (13, 21, 30)  # system prompts: 3, 5 and 7 full blocks of 4


def shared_prefix_arrivals() -> list[Arrival]:
    """System prompts with short questions, three choices of one prompt arriving
    together (n > 1), two aborts (one while its step runs)."""
    arrivals = []
    for i in range(12):
        system = i % len(SYSTEM_LENS)
        own = 1 + (5 * i) % 9
        arrivals.append(Arrival(
            f"q{i}", step=2 * i, prompt_len=SYSTEM_LENS[system] + own, max_tokens=6 + i % 5,
            output_len=None, prefix=f"s{system}", prefix_len=SYSTEM_LENS[system],
        ))  # fmt: skip
    for j in range(3):
        arrivals.append(Arrival(
            f"n{j}", step=5, prompt_len=26, max_tokens=8, output_len=None,
            prompt=prompt_for("choices", 26),
        ))  # fmt: skip
    arrivals[4].abort_step, arrivals[7].abort_step = 9, 14
    arrivals[7].abort_in_flight = True
    return arrivals


def serve_in_process(path, arrivals, *, ahead, **config):
    """The scheduler and the real runner in this process, plans executed in order."""
    from iterserve.workers.runner import ModelRunner

    num_blocks = config.pop("num_kv_blocks", 20)
    sched = Scheduler(SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4,
        num_kv_blocks=num_blocks, **config,
    ))  # fmt: skip
    runner = ModelRunner(path, dtype="float32", num_kv_blocks=num_blocks, block_size=4,
                         kernel_backend="torch")  # fmt: skip
    log = run(sched, runner, arrivals, ahead=ahead)
    return log, sched


@pytest.mark.parametrize("policy", ["continuous", "chunked"])
@pytest.mark.parametrize("ahead", [False, True])
def test_greedy_outputs_are_the_same_with_the_cache_on_and_off(tiny_llama, policy, ahead):
    """Shared system prompts, n > 1, preemption (20 blocks for 4 slots of 64
    tokens), aborts and scheduling ahead: every output is the one computed
    without the cache, and an aborted one is a prefix of it."""
    arrivals = shared_prefix_arrivals()
    plain = [Arrival(**{**a.__dict__, "abort_step": None}) for a in arrivals]
    reference, _ = serve_in_process(
        tiny_llama, plain, ahead=False, policy=policy, enable_prefix_caching=False
    )
    log, sched = serve_in_process(tiny_llama, arrivals, ahead=ahead, policy=policy)
    for a in arrivals:
        got, expected = log.outputs[a.key], reference.outputs[a.key]
        if log.reasons.get(a.key) == "abort":
            assert got == expected[: len(got)], a.key
        else:
            assert got == expected, a.key
    assert sched.num_prefix_hits > 0 and sched.num_preemptions > 0
    assert sched.blocks.num_used == 0


def test_a_chat_continued_on_its_cached_history_answers_as_recomputed(tiny_llama):
    """Each turn's prompt is the previous prompt, its answer and a new question:
    the answer's blocks, computed while decoding, are reused."""
    from iterserve.workers.runner import ModelRunner

    def chat(enable: bool) -> tuple[list[list[int]], int]:
        sched = Scheduler(SchedulerConfig(
            policy="chunked", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
            block_size=4, num_kv_blocks=48, enable_prefix_caching=enable,
        ))  # fmt: skip
        runner = ModelRunner(tiny_llama, dtype="float32", num_kv_blocks=48, block_size=4,
                             kernel_backend="torch")  # fmt: skip
        history, answers = prompt_for("system", 9), []
        for turn in range(4):
            history = history + prompt_for(f"question {turn}", 3)
            sched.add_request(Request(f"t{turn}", history, SamplingParams(
                temperature=0.0, max_tokens=7, ignore_eos=True)))  # fmt: skip
            answer: list[int] = []
            while sched.has_work:
                step = sched.schedule(0.0)
                for out in sched.update(runner.execute(step.plan)).outputs:
                    answer += out.new_token_ids
                sched.check_integrity()
            answers.append(answer)
            history = history + answer
        return answers, sched.num_prefix_hits

    expected, no_hits = chat(False)
    got, hits = chat(True)
    assert got == expected and no_hits == 0
    # Turns 2-4 found the previous turns' prompts and answers cached.
    assert hits >= 3 * 12


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_triton_kernels_and_decode_graphs_read_shared_blocks_as_their_own(tiny_llama):
    """Prefill pieces attending over cached blocks and replayed decodes whose
    tables start with shared blocks, on the Triton kernels (interpreted on the
    CPU, compiled on CUDA)."""
    from iterserve.workers.runner import ModelRunner

    device = "cuda" if torch.cuda.is_available() else "cpu"
    system = prompt_for("system", 19)
    prompts = [system + prompt_for(f"q{i}", 2 + i) for i in range(3)] + [system[:17]] * 2

    def serve(enable: bool) -> list[list[int]]:
        sched = Scheduler(SchedulerConfig(
            policy="chunked", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
            block_size=8, num_kv_blocks=32, enable_prefix_caching=enable,
        ))  # fmt: skip
        runner = ModelRunner(
            tiny_llama, dtype="float32", num_kv_blocks=32, block_size=8, device=device,
            kernel_backend="triton", cuda_graphs=True, graph_batch_sizes=(1, 4),
            max_model_len=64,
        )  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            sched.add_request(Request(f"r{i}", prompt, params))
        outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while sched.has_work:
            step = sched.schedule(0.0)
            for out in sched.update(runner.execute(step.plan)).outputs:
                outputs[out.request_id].extend(out.new_token_ids)
        assert runner.graphs.num_replays > 0
        if enable:
            assert sched.num_prefix_hits > 0
        return list(outputs.values())

    assert serve(True) == serve(False)


@pytest.mark.usefixtures("ray_session")
async def test_tensor_parallel_two_ranks_share_prefixes_as_one_process_computes(tiny_llama):
    prompts = [arrival_prompt(a) for a in shared_prefix_arrivals()]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = single_process_outputs(tiny_llama, prompts, params, enable_prefix_caching=False)
    engine = await start_engine(model_config(tiny_llama, tensor_parallel_size=2))
    try:
        results = await collect_all(engine, prompts, params)
        assert [tokens for tokens, _ in results] == expected
        stats = await wait_idle(engine)
        assert stats["prefix_caching"] and stats["prefix_cache_hits"] > 0
        assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_cached"] > 0
        await assert_sound(engine)
    finally:
        await engine.shutdown()


@pytest.mark.usefixtures("ray_session")
async def test_a_killed_rank_recovers_with_a_cleared_cache_and_the_same_outputs(tiny_llama):
    """The restarted ranks' KV is empty: a hash surviving the restart would hand
    recomputed requests blocks of garbage."""
    prompts = [arrival_prompt(a) for a in shared_prefix_arrivals()]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = single_process_outputs(tiny_llama, prompts, params, enable_prefix_caching=False)
    engine = await start_engine(model_config(tiny_llama, tensor_parallel_size=2))
    try:
        pids = await rank_pids(engine)
        tasks = asyncio.ensure_future(collect_all(engine, prompts, params))
        for _ in range(20_000):  # bounded; the kill lands mid-generation, after hits
            stats = await engine.stats()
            if stats["step"] >= 4 and stats["prefix_cache_hits"] > 0:
                break
            await asyncio.sleep(0.005)
        os.kill(pids[1], signal.SIGKILL)
        results = await asyncio.wait_for(tasks, HANG_GUARD_S)
        assert [tokens for tokens, _ in results] == expected
        stats = await wait_idle(engine)
        assert stats["rank_restarts"] == 1 and stats["kv_blocks_used"] == 0
    finally:
        await engine.shutdown()


def single_process_outputs(path, prompts, params, **config) -> list[list[int]]:
    """Every prompt at once through the scheduler and runner of this process."""
    from iterserve.workers.runner import ModelRunner

    sched = Scheduler(
        model_config(path, **config).scheduler.resolved(
            num_kv_blocks=96, max_model_len=64, device="cpu"
        )
    )
    runner = ModelRunner(path, dtype="float32", num_kv_blocks=96, block_size=4,
                         kernel_backend="torch")  # fmt: skip
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"r{i}", list(prompt), params))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while sched.has_work:
        step = sched.schedule(1e9)
        for out in sched.update(runner.execute(step.plan)).outputs:
            outputs[out.request_id].extend(out.new_token_ids)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.usefixtures("ray_session")
async def test_the_first_output_says_how_many_prompt_tokens_were_cached(tiny_llama):
    """What usage.prompt_tokens_details.cached_tokens reports: whole blocks found,
    short of the last prompt token, on the request's first output only."""
    engine = await start_engine(model_config(tiny_llama))
    prompt = prompt_for("system", 21)  # five full blocks of 4 and one token
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    try:
        first = [out async for out in engine.generate(prompt, params)]
        again = [out async for out in engine.generate(prompt, params)]
        assert first[0].num_cached_tokens == 0 and again[0].num_cached_tokens == 20
        assert all(out.num_cached_tokens is None for out in first[1:] + again[1:])
        assert [t for o in again for t in o.token_ids] == [t for o in first for t in o.token_ids]
    finally:
        await engine.shutdown()
