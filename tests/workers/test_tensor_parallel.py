"""TP=2 over gloo on CPU gives the same tokens as TP=1."""

from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp
from plan_driver import PlanDriver
from test_runner_greedy import make_runner, prompts
from tiny_checkpoints import short_context
from tp_worker import run_rank

from iterserve.scheduler.sampling import SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Dense: Llama; Phi-3's fused q/k/v and gate/up tensors sliced per rank; Gemma 3's
# norms and windows. Experts split by columns across ranks: Qwen3-MoE, Mixtral.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "phi3", "gemma3", "qwen3_moe", "mixtral"])
def test_tp2_matches_tp1(name, checkpoint_dir, hf_reference, tmp_path):
    path = checkpoint_dir(name)
    ps = prompts(4)
    context = short_context(name)
    driver = PlanDriver(make_runner(path, **context))
    for i, p in enumerate(ps):
        driver.add(f"g{i}", p)
    driver.add(
        "seeded", ps[0], SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    )
    expected = driver.run(chunk=7)
    hf = hf_reference(name)
    assert all(expected[f"g{i}"] == hf.greedy(p) for i, p in enumerate(ps))

    out_file = str(tmp_path / "tokens")
    args = (2, free_port(), str(path), ps, out_file, context.get("max_model_len"))
    mp.spawn(run_rank, args=args, nprocs=2, join=True)
    for rank in range(2):
        with open(f"{out_file}.{rank}") as f:
            assert json.load(f) == expected


@pytest.mark.slow
def test_tp2_ranks_apply_the_same_grammar_masks(tmp_path):
    from tp_worker import constrained_requests, run_constrained_rank

    from iterserve.models import DEMO_MODEL_PATH

    path = str(DEMO_MODEL_PATH)
    driver = PlanDriver(make_runner(path))
    for name, prompt, params in constrained_requests(path):
        driver.add(name, prompt, params)
    expected = driver.run(chunk=5)
    assert json.loads(tok_text(path, expected["greedy"]))  # the grammar held at TP=1

    out_file = str(tmp_path / "tokens")
    mp.spawn(run_constrained_rank, args=(2, free_port(), path, out_file), nprocs=2, join=True)
    for rank in range(2):
        with open(f"{out_file}.{rank}") as f:
            got = json.load(f)
        assert got["tokens"] == expected
        assert got["prompt_logprobs"] == (1 if rank == 0 else 0)  # only rank 0's are read


def tok_text(path: str, ids: list[int]) -> str:
    from iterserve.workers.tokenizer import Tokenizer

    return Tokenizer(path).decode(ids)
