"""Products on oneDNN-packed weights equal the plain ones, to rounding."""

import pytest
import torch
import torch.nn.functional as F

from iterserve.kernels import cpu_linear

packs = pytest.mark.skipif(
    cpu_linear.pack(torch.zeros(2, 2)) is None, reason="no oneDNN in this torch build"
)


@packs
@pytest.mark.parametrize("rows", [cpu_linear.MIN_ROWS, 128, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_product_matches_plain(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(160, 96, generator=g)
    bias = torch.randn(160, generator=g) if with_bias else None
    got = cpu_linear.linear(x, w, bias, cpu_linear.pack(w))
    torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-4, rtol=1e-5)


@packs
def test_few_rows_take_the_plain_product():
    x, w = torch.randn(cpu_linear.MIN_ROWS - 1, 32), torch.randn(48, 32)
    assert torch.equal(cpu_linear.linear(x, w, None, cpu_linear.pack(w)), F.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_only_fp32_weights_are_packed(dtype):
    assert cpu_linear.pack(torch.zeros(4, 4, dtype=dtype)) is None


def test_a_cpu_runner_packs_and_a_torch_runner_does_not():
    from iterserve.models import DEMO_MODEL_PATH
    from iterserve.workers.runner import ModelRunner

    for backend in ("cpu", "torch"):
        runner = ModelRunner(DEMO_MODEL_PATH, num_kv_blocks=8, kernel_backend=backend)
        packed = runner.model.lm_head_packed is not None
        assert packed == (backend == "cpu" and cpu_linear.pack(torch.zeros(2, 2)) is not None)
