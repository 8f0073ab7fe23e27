"""The numba kernels' scalar helpers: the vectorizable exponential is as close to
e**x as libm's over fp32's normal range and clamps outside it; a prefetch never
changes what is read."""

import numpy as np
import pytest

from iterserve.kernels import cpu_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="numba is not installed")

if cpu_attention.available():
    import numba

    from iterserve.kernels.cpu_math import exp_f32, prefetch_l2

    @numba.njit(fastmath=True)
    def _exp_all(x, out):
        for i in range(x.shape[0]):
            out[i] = exp_f32(x[i])

    @numba.njit
    def _copy_with_prefetch(x, out):
        for i in range(x.shape[0]):
            prefetch_l2(x, min(i + 64, x.shape[0] - 1))
            out[i] = x[i]


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
