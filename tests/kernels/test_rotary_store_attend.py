"""``rotary_store_attend``: a product's qkv rows split into heads, rotated, their
keys and values stored, every row attended. The cpu backend runs a bf16 batch of
decode rows and short pieces as one compiled call; it must equal its two ops one
after the other (the same kernels) to the bit, and the torch reference to bf16
rounding, and refuse what they refuse before writing anything."""

import pytest
import torch

from iterserve.kernels import build_cos_sin_cache, get_ops
from iterserve.kernels import reference as ref
from iterserve.kernels.cpu import attention as cpu_attention
from iterserve.kernels.cpu import ops as cpu_ops

from .attention_cases import DECODE, MIXED, make_batch

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="numba is not installed")

# bf16 against the reference: one bf16 step of the value, or 2**-8 absolute where
# the value is near 0 (the long pieces' flash attention sums in another order).
BF16_STEP = dict(atol=2**-8, rtol=2**-7)
LONG_DECODES = [(150, 1), (97, 1), (33, 1)]
# Whether this CPU runs the attention tiles, which the one-call path needs.
ONE_CALL_HERE = cpu_attention.TILES


def _inputs(shape, num_heads, num_kv_heads, dtype, seed, head_dim=64, block_size=16):
    """A batch's caches and metadata, and the qkv rows, positions and slots of its
    new tokens (the last ``q`` positions of each sequence)."""
    b = make_batch(shape, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=seed)
    positions, slots = [], []
    for s, (context, q) in enumerate(shape):
        for p in range(context, context + q):
            positions.append(p)
            slots.append(int(b.block_tables[s, p // block_size]) * block_size + p % block_size)
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(len(positions), (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    cos_sin = build_cos_sin_cache(head_dim, 256, 10000.0, None)
    return b, qkv.to(dtype), torch.tensor(positions), torch.tensor(slots), cos_sin


def _run(op, b, qkv, positions, slots, cos_sin, num_heads, num_kv_heads, **attention):
    """``op`` on copies of ``b``'s caches: its output and the caches it wrote."""
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    out = op(positions, qkv, num_heads, num_kv_heads, cos_sin, k_cache, v_cache, slots,
             b.block_tables, b.seq_lens, b.query_start_loc, b.scale, **attention)  # fmt: skip
    return out, k_cache, v_cache


def _counted(monkeypatch, name: str) -> list:
    """A list that grows by one each time ``cpu_ops.<name>`` runs."""
    calls = []
    kernel = getattr(cpu_ops, name)

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(cpu_ops, name, counted)
    return calls


@pytest.fixture
def one_calls(monkeypatch):
    """How many times the bf16 one-call kernel ran, on one torch thread (as a rank
    runs; on more the two ops run, their attention's rows over the threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _counted(monkeypatch, "_rotate_store_attend_rows")
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "shape, num_heads, num_kv_heads, attention",
    [
        (DECODE, 8, 2, {}),
        (LONG_DECODES, 16, 4, {}),
        (LONG_DECODES, 4, 4, {}),
        (DECODE + LONG_DECODES, 8, 2, {"window": 24}),
        (DECODE, 8, 2, {"soft_cap": 30.0}),
        (MIXED, 8, 2, {}),
    ],
)
def test_bf16_one_call_equals_the_two_ops(one_calls, shape, num_heads, num_kv_heads, attention):
    b, qkv, positions, slots, cos_sin = _inputs(shape, num_heads, num_kv_heads,
                                                torch.bfloat16, seed=21)  # fmt: skip
    args = (b, qkv, positions, slots, cos_sin, num_heads, num_kv_heads)
    got = _run(cpu_ops.rotary_store_attend, *args, **attention)
    two_ops = _run(cpu_ops._rotary_store_then_attend, *args, **attention)
    want = _run(ref.rotary_store_attend, *args, **attention)
    assert got[0].shape == (qkv.shape[0], num_heads * 64) and got[0].dtype == torch.bfloat16
    for g, t in zip(got, two_ops, strict=True):
        assert torch.equal(g, t)
    torch.testing.assert_close(got[0], want[0], **BF16_STEP)
    torch.testing.assert_close(got[1], want[1], **BF16_STEP)  # rotated keys: to rounding
    assert torch.equal(got[2], want[2])  # values are copied
    # a batch of decode rows takes the one call wherever the tiles run
    if ONE_CALL_HERE and all(q == 1 for _, q in shape):
        assert one_calls


@pytest.fixture
def loop_calls(monkeypatch):
    """How many times the fp32 one-call kernel (on the loop kernels) ran."""
    return _counted(monkeypatch, "_rotate_store_attend_rows_loops")


@pytest.mark.parametrize(
    "shape, head_dim, attention, in_one_call",
    [
        (DECODE, 64, {}, True),
        (LONG_DECODES, 8, {}, True),
        (MIXED, 64, {}, True),  # short pieces beside the decode rows
        ([(0, 64), (40, 1)], 64, {}, False),  # a long piece: the two ops
        (LONG_DECODES, 64, {"window": 24}, False),
        (DECODE, 64, {"soft_cap": 30.0}, False),
    ],
)
def test_fp32_equals_the_two_ops_and_the_reference(
    one_calls, loop_calls, shape, head_dim, attention, in_one_call
):
    """fp32 decode rows and short pieces take one call on the loop kernels (any
    head size), without a window that cuts or a cap; the rest the two ops."""
    b, qkv, positions, slots, cos_sin = _inputs(shape, 8, 2, torch.float32, seed=22,
                                                head_dim=head_dim)  # fmt: skip
    args = (b, qkv, positions, slots, cos_sin, 8, 2)
    got = _run(cpu_ops.rotary_store_attend, *args, **attention)
    two_ops = _run(cpu_ops._rotary_store_then_attend, *args, **attention)
    want = _run(ref.rotary_store_attend, *args, **attention)
    for g, t in zip(got, two_ops, strict=True):
        assert torch.equal(g, t)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
    assert torch.equal(got[2], want[2])
    assert not one_calls
    assert bool(loop_calls) == in_one_call


def test_a_layer_after_the_first_reads_positions_changed_in_place(one_calls):
    """Layers of one batch share what the first read from the metadata; a tensor
    changed in place since is read again."""
    b, qkv, positions, slots, cos_sin = _inputs(LONG_DECODES, 8, 2, torch.bfloat16, seed=23)
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    meta = (slots, b.block_tables, b.seq_lens, b.query_start_loc, b.scale)
    cpu_ops.rotary_store_attend(positions, qkv, 8, 2, cos_sin, k_cache, v_cache, *meta)
    positions.add_(1)  # the same tensor, other positions
    got = cpu_ops.rotary_store_attend(positions, qkv, 8, 2, cos_sin, k_cache, v_cache, *meta)
    want_k, want_v = b.k_cache.clone(), b.v_cache.clone()
    ref.rotary_store_attend(positions, qkv, 8, 2, cos_sin, want_k, want_v, *meta)
    assert torch.equal(k_cache, want_k)
    torch.testing.assert_close(
        got, ref.rotary_store_attend(positions, qkv, 8, 2, cos_sin, want_k, want_v, *meta),
        **BF16_STEP,
    )  # fmt: skip
    if ONE_CALL_HERE:
        assert len(one_calls) == 2


@pytest.mark.parametrize(
    "change, error, named",
    [
        (lambda p, s: p.__setitem__(1, 256), IndexError, r"positions\[1\]"),
        (lambda p, s: p.__setitem__(2, -1), IndexError, r"positions\[2\]"),
        (lambda p, s: s.__setitem__(0, 10_000), ValueError, "slot 10000"),
    ],
)
def test_bad_positions_and_slots_are_refused_before_anything_is_written(
    one_calls, change, error, named
):
    b, qkv, positions, slots, cos_sin = _inputs(LONG_DECODES, 8, 2, torch.bfloat16, seed=24)
    change(positions, slots)
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    with pytest.raises(error, match=named):
        cpu_ops.rotary_store_attend(positions, qkv, 8, 2, cos_sin, k_cache, v_cache, slots,
                                    b.block_tables, b.seq_lens, b.query_start_loc, b.scale)  # fmt: skip
    assert torch.equal(k_cache, b.k_cache) and torch.equal(v_cache, b.v_cache)


@pytest.mark.parametrize(
    "qkv_width, num_heads, named",
    [(8 * 64 + 2 * 2 * 64 - 1, 8, "qkv"), (12 * 64, True, "num_heads"), (12 * 64, 0, "num_heads")],
)
def test_bad_shapes_and_counts_are_named(one_calls, qkv_width, num_heads, named):
    b, _, positions, slots, cos_sin = _inputs(DECODE, 8, 2, torch.bfloat16, seed=25)
    qkv = torch.zeros(positions.shape[0], qkv_width, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=named):
        cpu_ops.rotary_store_attend(positions, qkv, num_heads, 2, cos_sin, b.k_cache, b.v_cache,
                                    slots, b.block_tables, b.seq_lens, b.query_start_loc,
                                    b.scale)  # fmt: skip


def test_every_backend_has_the_op():
    """The torch backend's is the reference; the others compose their own two ops
    where they have no fused one."""
    assert get_ops("torch").rotary_store_attend is ref.rotary_store_attend
    assert get_ops("cpu").rotary_store_attend is cpu_ops.rotary_store_attend


def test_a_cache_that_is_not_a_tensor_is_named(one_calls):
    b, qkv, positions, slots, cos_sin = _inputs(DECODE, 8, 2, torch.bfloat16, seed=26)
    with pytest.raises(ValueError, match="k_cache"):
        cpu_ops.rotary_store_attend(positions, qkv, 8, 2, cos_sin, "cache", b.v_cache, slots,
                                    b.block_tables, b.seq_lens, b.query_start_loc, b.scale)  # fmt: skip


@pytest.mark.parametrize(
    "attention, named",
    [({"window": 0}, "window"), ({"soft_cap": -1.0}, "soft_cap"), ({"scale": -0.1}, "scale")],
)
def test_bad_window_cap_and_scale_are_named_on_every_layer(one_calls, attention, named):
    """Named on a layer after the first too, whose batch the first layer checked."""
    b, qkv, positions, slots, cos_sin = _inputs(LONG_DECODES, 8, 2, torch.bfloat16, seed=27)
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    meta = (slots, b.block_tables, b.seq_lens, b.query_start_loc)
    cpu_ops.rotary_store_attend(positions, qkv, 8, 2, cos_sin, k_cache, v_cache, *meta, b.scale)
    scale = attention.pop("scale", b.scale)
    with pytest.raises(ValueError, match=named):
        cpu_ops.rotary_store_attend(positions, qkv, 8, 2, cos_sin, k_cache, v_cache, *meta, scale,
                                    **attention)  # fmt: skip


def test_ops_with_another_attention_attend_with_it_in_the_one_op_too():
    """Replacing a backend's attention (as a numerics study does) reaches the layers'
    one op as well."""
    seen = []

    def attention(*args, **kwargs):
        seen.append(1)
        return ref.paged_attention(*args, **kwargs)

    ops = get_ops("cpu").with_attention(attention)
    b, qkv, positions, slots, cos_sin = _inputs(DECODE, 8, 2, torch.float32, seed=28)
    got = _run(ops.rotary_store_attend, b, qkv, positions, slots, cos_sin, 8, 2)
    want = _run(ref.rotary_store_attend, b, qkv, positions, slots, cos_sin, 8, 2)
    assert seen and ops.paged_attention is attention
    torch.testing.assert_close(got[0], want[0])
