"""TP=2 over gloo on CPU gives the same tokens as TP=1."""

from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp
from plan_driver import PlanDriver
from test_runner_greedy import make_runner, prompts
from tp_worker import run_rank

from iterserve.scheduler.sampling import SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tp2_matches_tp1(checkpoint_dir, tmp_path):
    path = checkpoint_dir("llama")
    ps = prompts(4)
    driver = PlanDriver(make_runner(path))
    for i, p in enumerate(ps):
        driver.add(f"g{i}", p)
    driver.add(
        "seeded", ps[0], SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    )
    expected = driver.run(chunk=7)

    out_file = str(tmp_path / "tokens")
    mp.spawn(run_rank, args=(2, free_port(), str(path), ps, out_file), nprocs=2, join=True)
    for rank in range(2):
        with open(f"{out_file}.{rank}") as f:
            assert json.load(f) == expected
