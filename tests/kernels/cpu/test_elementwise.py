"""The cpu backend's compiled norms, rotary embedding, KV store and SiLU·mul equal
the torch references (to rounding) in fp32 and bf16, refuse what they refuse, and
leave other dtypes to them."""

import pytest
import torch

from iterserve.kernels import build_cos_sin_cache
from iterserve.kernels import reference as ref
from iterserve.kernels.cpu import activation, jit, norm, rotary

pytestmark = pytest.mark.skipif(not jit.available(), reason="numba is not installed")

CLOSE = dict(atol=1e-6, rtol=1e-5)
# bf16: both round the same fp32 value once, but the fp32 values may differ in their
# last bits (sums in another order, another exponential): at most one bf16 step,
# 2**-8 to 2**-7 of the value.
BF16_STEP = dict(atol=1e-6, rtol=2**-7)
TOLERANCE = {torch.float32: CLOSE, torch.bfloat16: BF16_STEP}


def _strided(rows, width, seed=0):
    """A [rows, width] view with a row stride wider than the row, as a slice of a
    fused projection's output is."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width + 16, generator=g)[:, 8 : 8 + width]


@pytest.mark.parametrize("rows", [1, 7, 128])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_matches_reference(rows, strided):
    g = torch.Generator().manual_seed(1)
    x = _strided(rows, 96) if strided else torch.randn(rows, 96, generator=g)
    weight = torch.rand(96, generator=g) + 0.5
    torch.testing.assert_close(norm.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5),
                               **CLOSE)  # fmt: skip


def test_rms_norm_with_residual_returns_the_sum_too():
    g = torch.Generator().manual_seed(2)
    x, residual = _strided(9, 64, seed=3), torch.randn(9, 64, generator=g)
    weight = torch.rand(64, generator=g)
    x_before, residual_before = x.clone(), residual.clone()
    out, summed = norm.rms_norm(x, weight, 1e-6, residual)
    want_out, want_sum = ref.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, want_out, **CLOSE)
    assert torch.equal(summed, want_sum)  # one addition each: exact
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (8, 1, 128), (2, 2, 32)])
def test_rotary_matches_reference_on_projection_views(num_heads, num_kv_heads, head_dim):
    """q and k as the model passes them: views into one [tokens, q + 2 kv] output."""
    tokens = 11
    cos_sin = build_cos_sin_cache(head_dim, 64, 10000.0, None)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.reshape(tokens, num_heads, head_dim), k.reshape(tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 63, 5, 5, 17, 30, 31, 32, 8])
    got_q, got_k = rotary.rotary_embedding(positions, q, k, cos_sin)
    want_q, want_k = ref.rotary_embedding(positions, q, k, cos_sin)
    torch.testing.assert_close(got_q, want_q, **CLOSE)
    torch.testing.assert_close(got_k, want_k, **CLOSE)


@pytest.mark.parametrize("bad", [64, -1])
def test_rotary_refuses_a_position_outside_the_cache(bad):
    cos_sin = build_cos_sin_cache(32, 64, 10000.0, None)
    q, k = torch.randn(3, 2, 32), torch.randn(3, 1, 32)
    with pytest.raises(IndexError, match=r"positions\[1\]"):
        rotary.rotary_embedding(torch.tensor([0, bad, 2]), q, k, cos_sin)


def _caches(num_blocks=4, block_size=4, heads=2, head_dim=8):
    return (torch.zeros(num_blocks, block_size, heads, head_dim),
            torch.zeros(num_blocks, block_size, heads, head_dim))  # fmt: skip


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_store_kv_matches_reference_and_skips_negative_slots(index_dtype):
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(5, 3, 2, 8, generator=g)  # a fused [k | v | other] layout
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.tensor([3, -1, 0, 15, 9], dtype=index_dtype)
    got, want = _caches(), _caches()
    rotary.store_kv(key, value, *got, slots)
    ref.store_kv(key, value, *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_store_kv_refuses_a_slot_past_the_cache_before_writing():
    k_cache, v_cache = _caches()
    key = torch.ones(2, 2, 8)
    with pytest.raises(ValueError, match="slot 16"):
        rotary.store_kv(key, key, k_cache, v_cache, torch.tensor([0, 16]))
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("contiguous", [True, False], ids=["tiles", "strided"])
def test_bf16_rms_norm_rounds_where_the_reference_rounds(rows, with_residual, contiguous):
    """Contiguous rows of whole 16-value tiles run on ``cpu_tiles``' vector tiles,
    strided ones on the loop; both round where the reference rounds."""
    g = torch.Generator().manual_seed(11)
    x = (_strided(rows, 96, seed=12) * 3).bfloat16()
    if not contiguous:
        x = torch.cat([x, x[:, :16]], dim=1)[:, :96]
    residual = torch.randn(rows, 96, generator=g).bfloat16() if with_residual else None
    weight = (torch.rand(96, generator=g) + 0.5).bfloat16()
    got, want = norm.rms_norm(x, weight, 1e-6, residual), ref.rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        assert torch.equal(got[1], want[1])  # one addition, rounded once: exact
        got, want = got[0], want[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, **BF16_STEP)


def test_bf16_rotary_matches_reference():
    cos_sin = build_cos_sin_cache(64, 128, 10000.0, None)
    g = torch.Generator().manual_seed(13)
    qkv = torch.randn(9, (4 + 2 * 2) * 64, generator=g).bfloat16()
    q, k, _ = qkv.split([256, 128, 128], dim=-1)
    q, k = q.reshape(9, 4, 64), k.reshape(9, 2, 64)
    positions = torch.tensor([0, 1, 127, 64, 5, 5, 17, 90, 33])
    for got, want in zip(rotary.rotary_embedding(positions, q, k, cos_sin),
                         ref.rotary_embedding(positions, q, k, cos_sin)):  # fmt: skip
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, **BF16_STEP)


def test_bf16_store_kv_copies_the_bits():
    g = torch.Generator().manual_seed(14)
    key, value = torch.randn(2, 5, 2, 8, generator=g).bfloat16()
    slots = torch.tensor([3, -1, 0, 15, 9])
    got = [c.bfloat16() for c in _caches()]
    want = [c.bfloat16() for c in _caches()]
    rotary.store_kv(key, value, *got, slots)
    ref.store_kv(key, value, *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("op, act", [("silu_mul", "silu"), ("gelu_tanh_mul", "gelu_pytorch_tanh")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_gated_activation_matches_reference_and_transformers_in_dtype(op, act, dtype, rows):
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(15)
    x = (torch.randn(rows, 2 * 88, generator=g) * 4).to(dtype)
    got = getattr(activation, op)(x)
    assert got.dtype == dtype and got.shape == (rows, 88)
    # The MLP in the checkpoint's dtype: the activation rounded, then the product.
    want = ACT2FN[act](x[:, :88]) * x[:, 88:]
    if op == "gelu_tanh_mul" and dtype == torch.bfloat16:
        # torch's tanh (Sleef's) and the tile's (Cephes') differ in their last fp32
        # bits: where that moves the value across a rounding boundary, one bf16 step,
        # and where tanh is near -1, values near 0 (at most ~1e-6 of the gate's)
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-4)
        assert (got == want).float().mean() > 0.9
        return
    torch.testing.assert_close(got, getattr(ref, op)(x), **TOLERANCE[dtype])
    assert torch.equal(got, want)


def test_bf16_silu_mul_equals_transformers_bit_for_bit_over_many_values():
    """The vector tile (on CPUs with AVX-512 BF16) and its scalar tail: rows of
    whole tiles plus a remainder, values from deep in the SiLU's tail to large."""
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(16)
    x = (torch.randn(96, 2 * 1032, generator=g) * 12).bfloat16()
    got = activation.silu_mul(x)
    assert torch.equal(got, ACT2FN["silu"](x[:, :1032]) * x[:, 1032:])
    # a strided view takes torch's ops, with the same values
    wide = torch.zeros(96, 2 * 1032 + 8, dtype=torch.bfloat16)
    wide[:, : 2 * 1032] = x
    assert torch.equal(activation.silu_mul(wide[:, : 2 * 1032]), got)
    assert activation.silu_mul(x[:0]).shape == (0, 1032)


@pytest.mark.parametrize("bf16_instruction", [False, True], ids=["integer", "vcvtneps2bf16"])
def test_tiles_round_to_bf16_alike_with_or_without_the_bf16_instruction(
    monkeypatch, bf16_instruction
):
    """The tiles round with ``vcvtneps2bf16`` where the CPU has AVX-512 BF16, else in
    integer lanes: either way the rotary and gated-product tiles give torch's values to
    the bit (each kernel compiled afresh, uncached, with one rounding or the other)."""
    import numba
    from transformers.activations import ACT2FN

    from iterserve.kernels.cpu import tiles as cpu_tiles

    if bf16_instruction and not cpu_tiles.available():
        pytest.skip("the CPU has no AVX-512 BF16")
    monkeypatch.setattr(cpu_tiles, "_HAS_BF16", bf16_instruction)
    for module, name in ((rotary, "rotate_store_tiles"), (activation, "_gated_mul_rows_bf16")):
        monkeypatch.setattr(module, name, numba.njit(getattr(module, name).py_func))
    g = torch.Generator().manual_seed(17)
    x = (torch.randn(9, 2 * 200, generator=g) * 6).bfloat16()
    assert torch.equal(activation.silu_mul(x), ACT2FN["silu"](x[:, :200]) * x[:, 200:])
    cos_sin = build_cos_sin_cache(64, 32, 10000.0, None)
    qkv = torch.randn(5, 8 * 64, generator=g).bfloat16()
    q, k, v = (t.reshape(5, -1, 64) for t in qkv.split([256, 128, 128], dim=-1))
    positions, slots = torch.tensor([0, 3, 31, 9, 9]), torch.tensor([1, 0, 4, 15, 2])
    got = [c.bfloat16() for c in _caches(heads=2, head_dim=64)]
    want = [c.bfloat16() for c in _caches(heads=2, head_dim=64)]
    got_q = rotary.rotary_store_kv(positions, q, k, v, cos_sin, *got, slots)
    want_q = ref.rotary_store_kv(positions, q, k, v, cos_sin, *want, slots)
    assert torch.equal(got_q, want_q) and torch.equal(got[0], want[0])


def test_fp16_takes_the_reference_path():
    x, weight = torch.randn(4, 32, dtype=torch.float16), torch.ones(32, dtype=torch.float16)
    assert torch.equal(norm.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
    cos_sin = build_cos_sin_cache(32, 16, 10000.0, None)
    q, k = torch.randn(4, 2, 32, dtype=torch.float16), torch.randn(4, 1, 32, dtype=torch.float16)
    positions = torch.arange(4)
    for got, want in zip(rotary.rotary_embedding(positions, q, k, cos_sin),
                         ref.rotary_embedding(positions, q, k, cos_sin)):  # fmt: skip
        assert torch.equal(got, want)


def test_bad_arguments_are_named_as_by_the_reference():
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm(torch.randn(3, 16), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        norm.rms_norm(torch.randn(3, 16), torch.ones(16), -1.0)
    k_cache, v_cache = _caches()
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary.store_kv(torch.ones(2, 2, 8), torch.ones(2, 2, 8), k_cache, v_cache,
                         torch.tensor([0]))  # fmt: skip


@pytest.mark.parametrize(
    "dtype,head_dim",
    [
        (torch.float32, 8),
        (torch.bfloat16, 8),
        (torch.bfloat16, 64),
        (torch.bfloat16, 96),
    ],  # fmt: skip
)
def test_rotary_store_kv_equals_rotary_then_store(dtype, head_dim):
    """The fused op returns the rotated query and writes the rotated key and the
    value to their slots, as the two ops one after the other do; negative slots
    are skipped. bf16 heads of 64 and 96 values take the vector tiles
    (``cpu_tiles.rotate_tile``), whose fp32 products and sums round as the
    reference's separate ops do: equal to the bit."""
    heads, kv_heads, tokens = 4, 2, 6
    cos_sin = build_cos_sin_cache(head_dim, 32, 10000.0, None)
    g = torch.Generator().manual_seed(15)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.tensor([0, 1, 31, 7, 7, 12])
    slots = torch.tensor([3, -1, 0, 15, 9, 4])
    got = [c.to(dtype) for c in _caches(heads=kv_heads, head_dim=head_dim)]
    want = [c.to(dtype) for c in _caches(heads=kv_heads, head_dim=head_dim)]
    got_q = rotary.rotary_store_kv(positions, q, k, v, cos_sin, *got, slots)
    want_q = ref.rotary_store_kv(positions, q, k, v, cos_sin, *want, slots)
    if head_dim % 32 == 0:
        assert torch.equal(got_q, want_q) and torch.equal(got[0], want[0])
    torch.testing.assert_close(got_q, want_q, **TOLERANCE[dtype])
    torch.testing.assert_close(got[0], want[0], **TOLERANCE[dtype])
    assert torch.equal(got[1], want[1])  # values are copied: exact
    assert not got[0].view(-1, kv_heads, head_dim)[1:3].any()  # slots no token named


@pytest.mark.parametrize(
    "positions, slots, error, named",
    [
        ([0, 32], [0, 1], IndexError, r"positions\[1\]"),
        ([0, -1], [0, 1], IndexError, r"positions\[1\]"),
        ([0, 1], [0, 16], ValueError, "slot 16"),
    ],
)
def test_rotary_store_kv_refuses_bad_positions_and_slots_before_writing(
    positions, slots, error, named
):
    cos_sin = build_cos_sin_cache(8, 32, 10000.0, None)
    k_cache, v_cache = _caches()
    q, k = torch.ones(2, 2, 8), torch.ones(2, 2, 8)
    with pytest.raises(error, match=named):
        rotary.rotary_store_kv(torch.tensor(positions), q, k, k, cos_sin, k_cache, v_cache,
                                torch.tensor(slots))  # fmt: skip
    assert not k_cache.any() and not v_cache.any()
