"""The quantized products' CPU kernels against their torch references
(:func:`iterserve.kernels.quant.linear`), on awkward shapes: inputs not a multiple
of a chunk, outputs not a multiple of a panel, 1 to 70 rows, biases, groups out
of order (GPTQ's ``g_idx``) and padded to whole chunks, zero points, static and
per-tensor activations, fp8 of both kinds; and the dispatch table's choice at
each instruction-set level.

int8 products are exact in int32 and scaled in fp32, as the reference: fp32
outputs agree within 1e-6 relative, bf16 ones within one bf16 rounding. The
widened products multiply bf16 weights (the reference's, widened the same way)
in fp32 sums: one bf16 rounding of the output."""

import pytest
import torch

from iterserve.kernels import quant as kq
from iterserve.kernels.cpu import amx as cpu_amx
from iterserve.kernels.cpu import dispatch, isa, quant_linear
from iterserve.workers.quant.load import layout

from .levels import at_level, fail_on

AMX = pytest.mark.skipif(not cpu_amx.available(), reason="the CPU has no AMX tiles")
BF16_STEP = dict(atol=1e-5, rtol=2**-7)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def w8a8(out_features, in_features, activations=kq.Activations(), seed=0):
    g = _gen(seed)
    values = torch.randint(-128, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    scales = torch.rand(out_features, generator=g) * 1e-3 + 1e-4
    return kq.QuantizedTensors(kq.W8A8, (out_features, in_features), values, scales,
                               activations=activations)  # fmt: skip


def wx(out_features, in_features, bits=4, number="int", group_size=32, shuffled=False,
       zeros=True, seed=0):  # fmt: skip
    g = _gen(seed)
    groups = -(-in_features // group_size)
    group_of = torch.arange(in_features) // group_size
    if shuffled:  # GPTQ's desc_act: each input's group in an order of its own
        group_of = group_of[torch.randperm(in_features, generator=g)]
    perm, chunk_groups = layout(group_of, groups)
    if number == "int":
        values = torch.randint(0, 1 << bits, (out_features, in_features), generator=g,
                               dtype=torch.uint8)  # fmt: skip
    else:
        values = (torch.randn(out_features, in_features, generator=g) * 4).to(
            kq.FP8_DTYPES[number]).view(torch.uint8)  # fmt: skip
    if perm is not None:
        values = torch.nn.functional.pad(values, (0, 1))[:, perm]
    scales = torch.rand(out_features, groups, generator=g) * 0.01 + 1e-3
    zero = None
    if zeros and number == "int":
        zero = torch.randint(0, 1 << bits, (out_features, groups), generator=g).float()
    return kq.QuantizedTensors(kq.WX, (out_features, in_features), values.contiguous(), scales,
                               zero, chunk_groups, perm, bits, number)  # fmt: skip


def _rows(rows, in_features, dtype, seed=1):
    return (torch.randn(rows, in_features, generator=_gen(seed)) * 2).to(dtype)


def _bias(out_features, seed=2):
    return torch.randn(out_features, generator=_gen(seed))


@AMX
@pytest.mark.parametrize("shape", [(32, 64), (40, 100), (96, 192), (1030, 1024)])
@pytest.mark.parametrize("rows", [1, 16, 17, 32, 33, 64, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_int8_equals_the_reference(shape, rows, dtype):
    q = w8a8(*shape, seed=rows)
    weight = quant_linear.pack(q, dtype)
    assert weight.kernel == "amx_int8"
    x, bias = _rows(rows, shape[1], dtype), _bias(shape[0])
    got, want = weight(x, bias), kq.linear(x, q, bias)
    assert got.dtype == dtype and got.shape == (rows, shape[0])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), **BF16_STEP)


@pytest.mark.parametrize(
    "activations",
    [
        kq.Activations(dynamic=True, per_token=False),
        kq.Activations(dynamic=True, symmetric=False),
        kq.Activations(dynamic=False, per_token=False, scale=0.02),
        kq.Activations(dynamic=False, per_token=False, symmetric=False, scale=0.03, zero=-7),
    ],
)
@pytest.mark.parametrize("level", ["avx512", "amx"])
def test_every_activation_scheme_on_each_int8_kernel(activations, level, monkeypatch):
    """Per-tensor, asymmetric and static activations: oneDNN's kernel (no AMX) and
    AMX's, each against the reference."""
    at_level(monkeypatch, level)
    q = w8a8(64, 160, activations)
    weight = quant_linear.pack(q, torch.float32)
    assert weight.kernel == ("amx_int8" if level == "amx" else "onednn_int8")
    x = _rows(20, 160, torch.float32)
    torch.testing.assert_close(weight(x, _bias(64)), kq.linear(x, q, _bias(64)),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_rows_are_quantized_as_compressed_tensors_does():
    """A row's largest magnitude is 127.5 steps: ``rint`` of -127.5 is -128, of 127.5
    is 128, saturated to 127; a row of zeros quantizes to zeros."""
    x = torch.tensor([[-127.5, 2.5, 3.5, 100.0], [127.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    xq, scale, zero = kq.quantize_rows(x, kq.Activations())  # scale 1: ties to even
    assert xq.tolist() == [[-128, 2, 4, 100], [127, 0, 0, 0], [0, 0, 0, 0]]
    assert scale.flatten().tolist() == [1.0, 1.0, 1.0] and zero.abs().sum() == 0
    ct = pytest.importorskip("compressed_tensors.quantization")
    args = ct.QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True,
                               dynamic=True)  # fmt: skip
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    big = _rows(16, 300, torch.float32)
    s, z = calculate_qparams(big.amin(1, keepdim=True), big.amax(1, keepdim=True), args)
    theirs = quantize(big, s, z, args, dtype=torch.int8)
    assert torch.equal(kq.quantize_rows(big, kq.Activations())[0], theirs)


@AMX
@pytest.mark.parametrize(
    "kind",
    [dict(bits=4), dict(bits=4, zeros=False), dict(bits=8), dict(bits=4, group_size=64),
     dict(bits=4, group_size=96), dict(bits=4, shuffled=True), dict(bits=8, number="e4m3"),
     dict(bits=8, number="e5m2"), dict(bits=4, group_size=16)],
    ids=["int4", "int4-symmetric", "int8", "g64", "g96", "g_idx", "e4m3", "e5m2", "g16"],
)  # fmt: skip
@pytest.mark.parametrize("shape", [(64, 128), (40, 96), (300, 256)])
@pytest.mark.parametrize("rows", [1, 17, 33, 64])
def test_amx_widen_equals_the_reference(kind, shape, rows):
    q = wx(*shape, **kind, seed=rows)
    weight = quant_linear.pack(q, torch.bfloat16)
    assert weight.kernel == "amx_widen"
    x, bias = _rows(rows, shape[1], torch.bfloat16), _bias(shape[0])
    got, want = weight(x, bias), kq.linear(x.float(), q, bias)
    # the reference in fp32 on the bf16-rounded weights: one rounding of the output
    want = torch.nn.functional.linear(kq.gather_inputs(x, q).float(),
                                      kq.dequantize(q, torch.bfloat16).float(), bias)  # fmt: skip
    torch.testing.assert_close(got.float(), want, **BF16_STEP)


@pytest.mark.parametrize("number", ["int", "e4m3"])
def test_the_widened_weight_is_the_dequantized_one(number):
    """``dequantize`` rounds ``(v - zero) * scale`` once: a 4-bit value of 5, zero 8,
    scale 0.5 is -1.5; an fp8 byte is its number."""
    q = wx(32, 32, bits=8 if number != "int" else 4, number=number, group_size=32)
    dense = kq.dequantize(q, torch.float32)
    v = kq.widen_values(q)
    zero = 0 if q.zeros is None else q.zeros[:, :1]
    assert torch.equal(dense, ((v - zero) * q.scales[:, :1]).float())
    if number == "e4m3":
        assert torch.equal(v, q.values.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("level", isa.LEVELS)
def test_each_level_packs_for_the_kernel_its_instructions_allow(level, monkeypatch):
    at_level(monkeypatch, level)
    amx = level == "amx"
    assert quant_linear.choose(w8a8(32, 64), torch.bfloat16) == (
        "amx_int8" if amx else "onednn_int8"
    )
    assert quant_linear.choose(wx(32, 64), torch.bfloat16) == ("amx_widen" if amx else "reference")
    assert quant_linear.choose(wx(32, 64), torch.float32) == "reference"
    assert quant_linear.choose(w8a8(32, 64), torch.float16) == "reference"


def test_without_amx_the_widened_products_take_the_reference(monkeypatch):
    at_level(monkeypatch, "avx512_bf16")
    from iterserve.kernels.cpu import amx_quant

    fail_on(monkeypatch, amx_quant, "dequant_product", "dequant_product_parallel")
    q = wx(64, 128)
    x = _rows(5, 128, torch.bfloat16)
    weight = quant_linear.pack(q, torch.bfloat16)
    torch.testing.assert_close(weight(x, None), kq.linear(x, q))


def test_the_table_describes_the_quantized_products_only_where_asked():
    traits = dispatch.model_traits(16, 4, 64, 1024)
    assert "linear.w8a8" not in dispatch.Dispatch("amx").describe(dispatch.BF16, traits)
    traits["linear.w8a8"] = frozenset()
    assert dispatch.Dispatch("amx").describe(dispatch.BF16, traits)["linear.w8a8"] == "amx_int8"


@AMX
def test_several_threads_split_the_panels(monkeypatch):
    """Two torch threads: each numba thread takes whole panels, so the outputs equal
    one thread's bit for bit."""
    q, x = w8a8(256, 128), _rows(40, 128, torch.bfloat16)
    weight = quant_linear.pack(q, torch.bfloat16)
    one = weight(x, None)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(weight(x, None), one)
        w = quant_linear.pack(wx(256, 128), torch.bfloat16)
        two = w(x, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two, w(x, None))
