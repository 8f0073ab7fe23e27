"""The AMX product kernel reads oneDNN's packed bf16 weights in place and equals
oneDNN's product of them (to the bit up to 32 rows; past 32 oneDNN sums some
values in another order: one bf16 step at most); ``cpu_linear.linear`` takes it
for the batches it serves and leaves the rest to oneDNN."""

import pytest
import torch

from iterserve.kernels.cpu import amx_linear as cpu_amx_linear
from iterserve.kernels.cpu import linear as cpu_linear

pytestmark = pytest.mark.skipif(
    not (cpu_amx_linear.available() and torch.backends.mkldnn.is_available()),
    reason="the CPU has no AMX-BF16 tiles, or torch has no oneDNN",
)

ONE_STEP = dict(atol=1e-6, rtol=2**-7)


def _weight(out_features, in_features, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g).bfloat16()


def _onednn(x, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@pytest.mark.parametrize("shape", [(32, 32), (96, 64), (256, 1024), (64, 2816)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 40, 48, 63, 64])
def test_the_product_equals_onednns(shape, rows):
    packed = cpu_linear.pack(_weight(*shape, seed=rows))
    assert packed.amx is not None
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    got, want = cpu_amx_linear.product(x, packed.amx, shape[0]), _onednn(x, packed.onednn)
    assert got.shape == (rows, shape[0]) and got.dtype == torch.bfloat16
    if rows <= 32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **ONE_STEP)
        assert (got == want).float().mean() > 0.99


def test_large_values_and_a_strided_batch():
    """Sums far from 1 round as oneDNN's do; ``linear`` copies a strided batch to
    the contiguous rows the kernel reads."""
    w = _weight(64, 128) * 1000
    packed = cpu_linear.pack(w)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(2)).bfloat16()[:, ::2]
    got = cpu_linear.linear(x, w, None, packed)
    assert torch.equal(got, _onednn(x.contiguous(), packed.onednn))


@pytest.mark.parametrize(
    "shape, dtype",
    [((40, 64), torch.bfloat16), ((64, 48), torch.bfloat16), ((64, 64), torch.float32)],
)
def test_weights_the_kernel_does_not_read_stay_onednns(shape, dtype):
    """Outputs or inputs not a multiple of 32, or fp32: no array, and ``linear``
    multiplies as before."""
    w = _weight(*shape).to(dtype)
    packed = cpu_linear.pack(w)
    assert packed.amx is None
    x = torch.randn(16, shape[1], generator=torch.Generator().manual_seed(3)).to(dtype)
    torch.testing.assert_close(cpu_linear.linear(x, w, None, packed), _onednn(x, packed.onednn))


@pytest.fixture
def amx_rows(monkeypatch):
    """The row counts of the products the kernel ran, on one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    seen = []
    product = cpu_amx_linear.product

    def spy(x, array, outputs):
        seen.append(x.shape[0])
        return product(x, array, outputs)

    monkeypatch.setattr(cpu_amx_linear, "product", spy)
    yield seen
    torch.set_num_threads(threads)


def test_linear_takes_the_kernel_for_up_to_64_rows_without_a_bias(amx_rows):
    w = _weight(128, 64)
    packed = cpu_linear.pack(w)
    amx_rows.clear()  # the check of its layout when packed
    assert packed.amx is not None
    g = torch.Generator().manual_seed(4)
    for rows in (1, 33, 64, 65, 96):
        cpu_linear.linear(torch.randn(rows, 64, generator=g).bfloat16(), w, None, packed)
    bias = torch.ones(128).bfloat16()
    got = cpu_linear.linear(torch.randn(8, 64, generator=g).bfloat16(), w, bias, packed)
    assert amx_rows == [1, 33, 64]
    assert got.shape == (8, 128)


def test_linear_on_more_threads_stays_onednns(amx_rows):
    w = _weight(128, 64)
    packed = cpu_linear.pack(w)
    amx_rows.clear()
    torch.set_num_threads(2)
    cpu_linear.linear(torch.ones(8, 64).bfloat16(), w, None, packed)
    assert amx_rows == []


def test_a_batch_of_the_wrong_width_is_refused_as_onednn_refuses_it(amx_rows):
    w = _weight(64, 64)
    packed = cpu_linear.pack(w)
    with pytest.raises(RuntimeError):
        cpu_linear.linear(torch.ones(4, 32).bfloat16(), w, None, packed)
