"""What ``dtype: auto`` picks on each kind of device and CPU (the CPU's features
faked), why it says it did, and that a configured dtype is taken as it is."""

import pytest
import torch

from iterserve.workers import dtype
from iterserve.workers.dtype import DtypeError, choose_dtype


@pytest.fixture
def cpu_with(monkeypatch):
    def fake(units: str | None) -> None:
        monkeypatch.setattr(dtype, "cpu_bf16_instructions", lambda: units)
        monkeypatch.setattr(dtype, "_compiled_kernels", lambda: True)

    return fake


@pytest.mark.parametrize("units", ["AMX", "avx512_bf16"])
def test_auto_is_bf16_on_a_cpu_that_multiplies_bf16_natively(cpu_with, units):
    cpu_with(units)
    for saved in ("float32", "bfloat16", "float16", None):
        choice = choose_dtype("auto", saved, "cpu")
        assert choice.dtype == torch.bfloat16 and choice.name == "bfloat16"
        assert units in choice.reason and choice.reason.startswith("auto")


def test_auto_is_fp32_on_a_cpu_without_bf16_instructions(cpu_with):
    cpu_with(None)
    choice = choose_dtype("auto", "bfloat16", "cpu")
    assert choice.dtype == torch.float32
    assert "no bf16 instructions" in choice.reason


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_auto_is_fp32_where_the_compiled_cpu_kernels_do_not_run(cpu_with, backend):
    """The torch references convert every bf16 tensor to fp32 and back: slower."""
    cpu_with("AMX")
    assert choose_dtype("auto", "bfloat16", "cpu", backend).dtype == torch.float32
    assert choose_dtype("auto", "bfloat16", "cpu", "cpu").dtype == torch.bfloat16


def test_auto_is_fp32_when_numba_is_missing(monkeypatch):
    monkeypatch.setattr(dtype, "cpu_bf16_instructions", lambda: "AMX")
    monkeypatch.setattr(dtype, "_compiled_kernels", lambda: False)
    assert choose_dtype("auto", "bfloat16", "cpu").dtype == torch.float32


def test_auto_on_an_accelerator_is_the_checkpoint_s_dtype(cpu_with):
    cpu_with("AMX")  # the host's CPU does not matter there
    assert choose_dtype("auto", "bfloat16", "cuda").dtype == torch.bfloat16
    assert choose_dtype("auto", "float16", "cuda:1").dtype == torch.float16
    assert choose_dtype("auto", "torch.float32", "cuda").dtype == torch.float32
    unnamed = choose_dtype("auto", None, "cuda")
    assert unnamed.dtype == torch.float32 and "names no dtype" in unnamed.reason


def test_a_configured_dtype_is_taken_on_any_device(cpu_with):
    cpu_with(None)
    for name, want in (("float16", torch.float16), ("bf16", torch.bfloat16),
                       ("float32", torch.float32)):  # fmt: skip
        for device in ("cpu", "cuda"):
            choice = choose_dtype(name, "float32", device)
            assert choice.dtype == want and choice.reason == "configured"
    assert choose_dtype(torch.bfloat16, None, "cpu").dtype == torch.bfloat16


@pytest.mark.parametrize("bad", ["int8", "fp8", ""])
def test_an_unknown_dtype_is_refused_by_name(bad):
    with pytest.raises(DtypeError, match=f"unsupported dtype {bad!r}"):
        choose_dtype(bad, None, "cpu")


def test_this_machine_s_answer_is_one_of_the_known_units():
    assert dtype.cpu_bf16_instructions() in (None, "AMX", "avx512_bf16")
