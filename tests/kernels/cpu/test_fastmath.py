"""The numba kernels' helpers: the vectorizable exponential is as close to e**x as
libm's over fp32's normal range and clamps outside it; a prefetch never changes
what is read; a bf16 tensor's bits are read as torch reads them and fp32 values
rounded as torch rounds them."""

import numpy as np
import pytest
import torch

from iterserve.kernels.cpu import jit

pytestmark = pytest.mark.skipif(not jit.available(), reason="numba is not installed")

if jit.available():
    import numba

    from iterserve.kernels.cpu.fastmath import (
        as_array,
        exp_f32,
        load_f32,
        prefetch_l2,
        round_to,
        store_f32,
        tanh_f32,
    )

    @numba.njit(fastmath=True)
    def _widen(src, out):
        for i in range(src.shape[0]):
            out[i] = load_f32(src, i)

    @numba.njit(fastmath=True)
    def _store_all(x, out):
        for i in range(x.shape[0]):
            store_f32(out, i, x[i])

    @numba.njit(fastmath=True)
    def _round_all(like, x, out):
        for i in range(x.shape[0]):
            out[i] = round_to(like, x[i])

    @numba.njit(fastmath=True)
    def _exp_all(x, out):
        for i in range(x.shape[0]):
            out[i] = exp_f32(x[i])

    @numba.njit(fastmath=True)
    def _tanh_all(x, out):
        for i in range(x.shape[0]):
            out[i] = tanh_f32(x[i])

    @numba.njit
    def _copy_with_prefetch(x, out):
        for i in range(x.shape[0]):
            prefetch_l2(x, min(i + 64, x.shape[0] - 1))
            out[i] = x[i]


def test_tanh_f32_is_within_an_ulp_of_the_exact_value_and_saturates_to_one():
    """Over both of its formulas and the switch between them (|x| = 0.625), down to
    tiny arguments (where tanh x is x) and out past saturation."""
    x = np.concatenate([
        np.linspace(-20.0, 20.0, 2_000_001, dtype=np.float32),
        np.float32(10.0) ** np.linspace(-30.0, 1.0, 100_001, dtype=np.float32),
        np.array([0.0, 0.625, -0.625, 44.0, 100.0, 1e30], dtype=np.float32),
    ])  # fmt: skip
    x = np.concatenate([x, -x])
    got = np.empty_like(x)
    _tanh_all(x, got)
    exact = np.tanh(x.astype(np.float64))
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert float(np.max(np.abs(got - exact) / ulp)) <= 1.0
    assert np.all(np.abs(got) <= 1.0)
    assert got[x >= 10.0].min() == 1.0 and got[x <= -10.0].max() == -1.0


def test_exp_f32_is_within_a_few_ulp_of_the_exact_value_over_the_normal_range():
    x = np.linspace(-87.0, 88.0, 2_000_001, dtype=np.float32)
    got = np.empty_like(x)
    _exp_all(x, got)
    exact = np.exp(x.astype(np.float64))
    assert np.all(np.isfinite(got))
    assert float(np.max(np.abs(got - exact) / exact)) < 2.5e-7  # 2 ulp of fp32


def test_exp_f32_takes_a_softmax_s_small_and_zero_inputs_exactly_where_libm_does():
    x = np.array([0.0, -1e-8, -0.5, -20.0], dtype=np.float32)
    got = np.empty_like(x)
    _exp_all(x, got)
    assert got[0] == 1.0
    np.testing.assert_allclose(got, np.exp(x.astype(np.float64)), rtol=2.5e-7)


def test_exp_f32_clamps_inputs_outside_the_normal_range():
    x = np.array([-1000.0, -88.0, 89.0, 1000.0], dtype=np.float32)
    got = np.empty_like(x)
    _exp_all(x, got)
    smallest_normal = np.finfo(np.float32).tiny
    assert np.all(got[:2] >= smallest_normal)
    np.testing.assert_allclose(got[:2], smallest_normal, rtol=1e-5)
    np.testing.assert_allclose(got[2:], np.exp(88.0), rtol=2.5e-7)
    assert np.all(np.isfinite(got))


def test_a_prefetch_leaves_what_is_read_unchanged():
    x = np.random.default_rng(0).standard_normal((100, 100)).astype(np.float32)
    out = np.empty(x.size, dtype=np.float32)
    _copy_with_prefetch(x.reshape(-1), out)
    assert np.array_equal(out, x.reshape(-1))


def _fp32_cases() -> torch.Tensor:
    """Random values over many magnitudes, every tie between two bf16 neighbours
    of a few exponents, subnormals, the largest finite values, infinities, zeros."""
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(200_000, generator=g) * torch.exp2(
        torch.randint(-130, 128, (200_000,), generator=g).float()
    )
    ties = (torch.arange(1 << 16, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    specials = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.4028235e38, -3.4028235e38,
                             float("inf"), -float("inf"), 3.3961776e38])  # fmt: skip
    return torch.cat([spread, ties, specials])


def test_bf16_bits_read_as_the_values_torch_reads():
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)
    got = np.empty(1 << 16, dtype=np.float32)
    _widen(as_array(every), got)
    want = every.float().numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_fp32_is_rounded_to_bf16_as_torch_rounds_it_to_nearest_even():
    x = _fp32_cases()
    x = x[~torch.isnan(x)]
    got = torch.empty(x.shape, dtype=torch.bfloat16)
    _store_all(x.numpy(), as_array(got))
    assert torch.equal(got.view(torch.uint16), x.bfloat16().view(torch.uint16))
    rounded = np.empty(x.shape[0], dtype=np.float32)
    _round_all(as_array(got), x.numpy(), rounded)  # round_to: the same value, as fp32
    assert np.array_equal(rounded.view(np.uint32), x.bfloat16().float().numpy().view(np.uint32))


def test_nan_stays_nan_whatever_its_payload():
    payloads = torch.tensor([0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFFF8000],
                            dtype=torch.int64).to(torch.int32).view(torch.float32)  # fmt: skip
    got = torch.empty(5, dtype=torch.bfloat16)
    _store_all(payloads.numpy(), as_array(got))
    assert torch.isnan(got).all()


def test_fp32_arrays_are_read_and_written_as_they_are():
    x = _fp32_cases().numpy()
    out, widened, rounded = (np.empty_like(x) for _ in range(3))
    _store_all(x, out)
    _widen(x, widened)
    _round_all(x, x, rounded)
    for y in (out, widened, rounded):
        assert np.array_equal(y.view(np.uint32), x.view(np.uint32))


def test_kernels_compile_for_512_bit_vectors_where_the_cpu_has_them():
    from llvmlite import binding

    host = binding.get_host_cpu_features().flatten().split(",")
    features = (numba.config.CPU_FEATURES or "").split(",")
    if "+avx512f" in host and "ITERSERVE_CPU_ISA" not in __import__("os").environ:
        assert "-prefer-256-bit" in features
