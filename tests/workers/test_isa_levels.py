"""The model runs on every kind of CPU: capped at AVX2 (``ITERSERVE_CPU_ISA``, in a
fresh process, so that oneDNN and numba's target are capped too), the compiled
backend's greedy tokens are the references' in fp32, and its bf16 logits the
references' to bf16 rounding; ``auto`` picks fp32 there, by rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from iterserve.kernels.cpu import isa

SCRIPT = """
import json, sys, torch
sys.path.insert(0, {workers!r})
from plan_driver import GREEDY, PlanDriver
from iterserve.kernels.cpu import dispatch, isa
from iterserve.models import DEMO_MODEL_PATH
from iterserve.scheduler.messages import NewSequence, ScheduledSeq, StepPlan
from iterserve.workers.batch import build_batch
from iterserve.workers.runner import ModelRunner


def prefill_logits(runner, prompt):
    # the logits of every row of the prompt, computed as one piece
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    plan = StepPlan(step=0, new_seqs=[NewSequence(0, "p", 0, prompt, len(prompt), GREEDY)],
                    scheduled=[ScheduledSeq(0, 0, len(prompt), blocks)])
    runner.table.apply(plan)
    batch = build_batch(plan, runner.table, block_size=runner.block_size,
                        scratch_block=runner.kv_cache.scratch_block, pad_token_id=0,
                        max_position=runner.model.cos_sin.shape[0], device=runner.device)
    return runner.model(batch.input_ids, batch.attn, torch.arange(len(prompt))).float()

prompts = [[1, 17, 400, 33, 9], [1, 5, 6, 7, 8, 9, 10, 11, 12, 250, 251]]
out = {{"level": isa.level(), "kernels": dispatch.current().describe(
    "bfloat16", dispatch.model_traits(4, 2, 64, 256))}}
for backend in ("cpu", "torch"):
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(DEMO_MODEL_PATH, dtype=dtype, num_kv_blocks=64,
                             kernel_backend=backend)
        driver = PlanDriver(runner)
        for i, p in enumerate(prompts):
            driver.add(f"r{{i}}", p)
        out[backend + "-" + dtype] = driver.run(chunk=3)
        if dtype == "bfloat16":
            fresh = ModelRunner(DEMO_MODEL_PATH, dtype=dtype, num_kv_blocks=64,
                                kernel_backend=backend)
            out[backend + "-logits"] = prefill_logits(fresh, prompts[1]).tolist()
auto = ModelRunner(DEMO_MODEL_PATH, num_kv_blocks=8)
out["auto"] = [auto.choices.dtype, auto.choices.dtype_reason]
print(json.dumps(out))
"""


@pytest.mark.skipif(not isa.at_least(isa.hardware(), "avx2"), reason="the CPU lacks AVX2")
def test_a_cpu_capped_at_avx2_serves_the_references_tokens():
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA",
                                                            "NUMBA_CPU_FEATURES")}  # fmt: skip
    env["ITERSERVE_CPU_ISA"] = "avx2"
    script = SCRIPT.format(workers=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["level"] == "avx2"
    assert out["kernels"]["attention.rows"] == "loops" and out["kernels"]["rms_norm"] == "loops"
    assert out["cpu-float32"] == out["torch-float32"]
    # bf16: the references compute each op in fp32 and round its output, the kernels
    # round where transformers' bf16 model rounds, so greedy runs may part at a near
    # tie; the logits agree to what four layers of bf16 rounding allow
    got, want = (torch.tensor(out[k + "-logits"]) for k in ("cpu", "torch"))
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert out["auto"][0] == "float32" and "avx2" in out["auto"][1]
