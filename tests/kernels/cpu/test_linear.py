"""Products on oneDNN-packed weights equal the plain ones, to rounding."""

import pytest
import torch
import torch.nn.functional as F

from iterserve.kernels.cpu import linear as cpu_linear

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


@packs
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_every_bf16_batch_takes_the_packed_weight(rows):
    """Even one row: the plain bf16 weight may be gone (it is let go once packed)."""
    g = torch.Generator().manual_seed(rows)
    x, w = (
        torch.randn(rows, 96, generator=g).bfloat16(),
        torch.randn(160, 96, generator=g).bfloat16(),
    )
    packed = cpu_linear.pack(w)
    assert packed is not None and cpu_linear.packs_every_batch(torch.bfloat16)
    got = cpu_linear.linear(x, w.new_empty(0), None, packed)
    # Both sum bf16 products in fp32 and round once: at most one bf16 step apart.
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-3, rtol=2**-7)


def test_fp16_weights_are_not_packed():
    assert cpu_linear.pack(torch.zeros(4, 4, dtype=torch.float16)) is None
    assert not cpu_linear.packs_every_batch(torch.float32)


def test_a_cpu_runner_packs_and_a_torch_runner_does_not():
    from iterserve.models import DEMO_MODEL_PATH
    from iterserve.workers.runner import ModelRunner

    for backend in ("cpu", "torch"):
        runner = ModelRunner(DEMO_MODEL_PATH, num_kv_blocks=8, kernel_backend=backend)
        packed = runner.model.lm_head_packed is not None
        assert packed == (backend == "cpu" and cpu_linear.pack(torch.zeros(2, 2)) is not None)


@packs
def test_a_bf16_runner_keeps_only_the_packed_products_and_the_embedding():
    from iterserve.models import DEMO_MODEL_PATH
    from iterserve.workers.runner import ModelRunner

    runner = ModelRunner(DEMO_MODEL_PATH, dtype="bfloat16", num_kv_blocks=8, kernel_backend="cpu")
    layer = runner.model.layers[0]
    assert layer.attn.qkv_packed is not None and layer.attn.qkv_weight.numel() == 0
    assert layer.mlp.down_weight.numel() == 0
    assert runner.model.embed.numel() == runner.config.vocab_size * runner.config.hidden_size


def rows_reaching_onednn(monkeypatch) -> list[int]:
    """The row count of every packed product from here on, in order."""
    seen: list[int] = []
    product = torch.ops.mkldnn._linear_pointwise

    def spy(inputs, *args):
        seen.append(inputs.shape[0])
        return product(inputs, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    return seen


@packs
@pytest.mark.parametrize("rows", [17, 24, 32])
def test_a_cliff_batch_runs_padded_and_keeps_its_values(rows, monkeypatch):
    """Where the engine chose padding for a weight, its batches of 17–32 rows reach
    oneDNN as 33 rows; the caller gets its own rows back, as the unpadded product
    has them."""
    monkeypatch.setattr(cpu_linear.isa, "level", lambda: "amx")
    g = torch.Generator().manual_seed(rows)
    out_features = cpu_linear.CLIFF_MIN_BYTES // (2 * 256)
    x = torch.randn(rows, 256, generator=g).bfloat16()
    w = torch.randn(out_features, 256, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    assert cpu_linear.may_pad_cliff(w.shape, torch.bfloat16)
    packed = cpu_linear.pack(w, pad_cliff=True)  # (checks the AMX kernel's reading of it)
    assert packed.pad_cliff
    product, seen = torch.ops.mkldnn._linear_pointwise, rows_reaching_onednn(monkeypatch)
    got = cpu_linear.linear(x, w.new_empty(0), bias, packed)  # a bias: oneDNN's product
    assert seen == [cpu_linear.CLIFF_ROWS[1] + 1]
    assert got.shape == (rows, out_features)
    direct = product(x, packed.onednn, bias, "none", [], "")
    torch.testing.assert_close(got, direct, atol=0, rtol=0)
    unpadded = cpu_linear.pack(w)  # the engine's choice: no padding
    seen.clear()
    cpu_linear.linear(x, w.new_empty(0), bias, unpadded)
    assert seen == [rows]


def test_the_cliff_applies_only_to_large_bf16_weights_with_short_rows_on_amx(monkeypatch):
    monkeypatch.setattr(cpu_linear.isa, "level", lambda: "amx")
    big = (5632, 1024)
    assert cpu_linear.may_pad_cliff(big, torch.bfloat16)
    assert not cpu_linear.may_pad_cliff(big, torch.float32)
    assert not cpu_linear.may_pad_cliff((256, 128), torch.bfloat16)  # stays in cache
    assert not cpu_linear.may_pad_cliff((2048, 8192), torch.bfloat16)  # long rows
    monkeypatch.setattr(cpu_linear.isa, "level", lambda: "avx512_bf16")
    assert not cpu_linear.may_pad_cliff(big, torch.bfloat16)


@pytest.mark.parametrize("padded_cost", [1.0, 0.9, 0.6])
def test_the_cliff_is_measured_by_timing_both_products(padded_cost, monkeypatch):
    """The measurement times plain and padded products of the shape asked about,
    alternately, and gives the ratio of their medians."""
    clock = [0.0]
    calls = []

    def fake_product(x, w, bias, run_rows):
        pad = run_rows > x.shape[0]
        calls.append(pad)
        clock[0] += padded_cost if pad else 1.0

    monkeypatch.setattr(cpu_linear, "_reorder", lambda weight: weight)
    monkeypatch.setattr(cpu_linear, "_product", fake_product)
    monkeypatch.setattr(cpu_linear.time, "thread_time", lambda: clock[0])
    assert cpu_linear.measure_cliff(64, 32) == pytest.approx(padded_cost)
    assert calls.count(True) == calls.count(False) > 0


@packs
@pytest.mark.parametrize("rows", [65, 96, 97, 130, 511])
def test_products_past_64_rows_run_at_a_multiple_of_32_and_keep_their_values(rows, monkeypatch):
    """oneDNN compiles a kernel per row count: long batches reach it at one of few
    counts, padded with zero rows whose outputs are dropped."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g).bfloat16()
    w = torch.randn(48, 64, generator=g).bfloat16()
    packed = cpu_linear.pack(w)
    product, seen = torch.ops.mkldnn._linear_pointwise, rows_reaching_onednn(monkeypatch)
    got = cpu_linear.linear(x, w.new_empty(0), None, packed)
    assert seen == [-(-rows // 32) * 32] and got.shape == (rows, 48)
    torch.testing.assert_close(got, product(x, packed.onednn, None, "none", [], ""), atol=0, rtol=0)
    assert cpu_linear.bucket_rows(64) == 64 and cpu_linear.bucket_rows(7) == 7
