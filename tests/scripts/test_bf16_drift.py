"""scripts/bf16_drift.py, the study behind the device check's bf16 limit: its
emulation of the Triton kernels' numerics agrees with the interpreted kernels,
a correct emulated path keeps the torch path's error against fp32, and a
planted fault does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import gpu_check  # noqa: E402
from bf16_drift import emulated_attention, study  # noqa: E402


@pytest.mark.parametrize(
    "shape",
    [[(300, 1), (40, 1)], [(0, 150), (37, 70)], [(100, 1), (0, 40)]],
    ids=["decode_split", "prefill", "mixed"],
)
def test_emulation_rounds_where_the_interpreted_kernels_do(shape):
    from iterserve.kernels import reference, triton_attention

    args = gpu_check.attention_case(torch, torch.device("cpu"), torch.float16, shape, heads=8,
                                    kv_heads=2, head_dim=128)  # fmt: skip
    kernel = triton_attention.paged_attention(*args).float()
    ref = reference.paged_attention(*args).float()
    emu = emulated_attention(torch.float16, plan_kv_heads=2)(*args).float()
    # fp16 softmax weights before P.V: the kernel and the emulation round them
    # alike; the reference keeps them in fp32.
    assert float((emu - kernel).abs().max()) <= float((ref - kernel).abs().max()) / 4


def test_a_correct_path_keeps_the_reference_error_and_a_lost_split_does_not():
    fine = study(hidden=256, layers=2, vocab=512, lens=(600, 9), seed=0)
    for step in ("prefill", "decode"):
        for t, e in zip(fine[step]["torch"], fine[step]["triton"]):
            assert t > 1e-3 and 0.8 < e / t < 1.25
    lost = study(hidden=256, layers=2, vocab=512, lens=(600, 9), seed=0, bug="lost_split")
    assert lost["prefill"]["triton"] == fine["prefill"]["triton"]  # prefill has no splits
    for t, e in zip(lost["decode"]["torch"], lost["decode"]["triton"]):
        assert e / t > 1.5
