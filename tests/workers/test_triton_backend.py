"""The runner on the Triton kernels (interpreted on CPU, see tests/conftest.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from plan_driver import PlanDriver
from tiny_checkpoints import short_context

from iterserve.scheduler.sampling import SamplingParams
from iterserve.workers import ModelRunner

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


# Llama; sliding and full layers with capped scores (Gemma 2); experts beside a dense
# layer (Qwen3-MoE); a window shorter than the sequences and a partial rotary (Phi-3).
@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3_moe", "phi3"])
def test_triton_backend_matches_transformers(name, checkpoint_dir, hf_reference):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = ModelRunner(
        checkpoint_dir(name),
        num_kv_blocks=32,
        block_size=8,
        device=device,
        kernel_backend="triton",
        **short_context(name),
    )
    assert runner.ops.name == "triton"
    # Long enough to pass every window (20..40) while decoding.
    prompts = {"a": [(7 * i) % 250 for i in range(41)], "b": list(range(5, 9))}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    driver = PlanDriver(runner)
    for rid, p in prompts.items():
        driver.add(rid, p, params)
    out = driver.run(chunk=17, padding_slots=[9], pad_tokens=lambda seq: 1)
    hf = hf_reference(name)
    assert out == {rid: hf.greedy(p, max_new_tokens=4) for rid, p in prompts.items()}
