"""The runner on the Triton kernels (interpreted on CPU, see tests/conftest.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from plan_driver import PlanDriver

from iterserve.scheduler.sampling import SamplingParams
from iterserve.workers import ModelRunner

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


def test_triton_backend_matches_transformers(checkpoint_dir, hf_reference):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = ModelRunner(
        checkpoint_dir("llama"),
        num_kv_blocks=32,
        block_size=8,
        device=device,
        kernel_backend="triton",
    )
    assert runner.ops.name == "triton"
    prompts = {"a": list(range(1, 12)), "b": list(range(5, 9))}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    driver = PlanDriver(runner)
    for rid, p in prompts.items():
        driver.add(rid, p, params)
    out = driver.run(chunk=5, padding_slots=[9], pad_tokens=lambda seq: 1)
    hf = hf_reference("llama")
    assert out == {rid: hf.greedy(p, max_new_tokens=4) for rid, p in prompts.items()}
