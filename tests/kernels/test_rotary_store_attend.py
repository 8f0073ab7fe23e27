"""``rotary_store_attend``: a product's qkv rows split into heads, rotated, their
keys and values stored, every row attended. The cpu backend runs a bf16 batch of
decode rows and short pieces as one compiled call (``kernels/cpu/layer.py``); it
must equal its two ops one after the other (the same kernels) to the bit, and the
torch reference to bf16 rounding, and refuse what they refuse before writing
anything. A layer bound once at load and called with a step's plan computes the
same as the op called alone."""

import pytest
import torch

from iterserve.kernels import AttentionMetadata, build_cos_sin_cache, get_ops
from iterserve.kernels import reference as ref
from iterserve.kernels.cpu import attention as cpu_attention
from iterserve.kernels.cpu import isa, jit, layer, rotary
from iterserve.kernels.cpu import plan as cpu_plan

from .attention_cases import DECODE, MIXED, make_batch

pytestmark = pytest.mark.skipif(not jit.available(), reason="numba is not installed")

# bf16 against the reference: one bf16 step of the value, or 2**-8 absolute where
# the value is near 0 (the long pieces' flash attention sums in another order).
BF16_STEP = dict(atol=2**-8, rtol=2**-7)
LONG_DECODES = [(150, 1), (97, 1), (33, 1)]
# Whether this CPU runs the attention tiles, which the bf16 one call takes.
ONE_CALL_HERE = isa.at_least(isa.level(), "avx512_bf16")
# The same kernels as two ops, one after the other.
two_ops_of = ref.rotary_store_then_attend(rotary.rotary_store_kv, cpu_attention.paged_attention)


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
    """A list that grows by one each time ``layer.<name>`` runs."""
    calls = []
    kernel = getattr(layer, name)

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(layer, name, counted)
    return calls


@pytest.fixture
def one_calls(monkeypatch):
    """How many times the bf16 one-call kernel ran, on one torch thread (as a rank
    runs; on more the two ops run, their attention's rows over the threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _counted(monkeypatch, "_one_call_tiles")
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
    got = _run(layer.rotary_store_attend, *args, **attention)
    two_ops = _run(two_ops_of, *args, **attention)
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
    """How many times the one-call kernel on the loops ran."""
    return _counted(monkeypatch, "_one_call_loops")


@pytest.mark.parametrize(
    "shape, head_dim, attention, in_one_call",
    [
        (DECODE, 64, {}, True),
        (LONG_DECODES, 8, {}, True),
        (MIXED, 64, {}, True),  # short pieces beside the decode rows
        ([(0, 64), (40, 1)], 64, {}, False),  # a long piece: the two ops
        (LONG_DECODES, 64, {"window": 24}, True),
        (DECODE, 64, {"soft_cap": 30.0}, True),
    ],
)
def test_fp32_equals_the_two_ops_and_the_reference(
    one_calls, loop_calls, shape, head_dim, attention, in_one_call
):
    """fp32 decode rows and short pieces take one call on the loop kernels (any
    head size, any window or cap); a batch with a long piece the two ops."""
    b, qkv, positions, slots, cos_sin = _inputs(shape, 8, 2, torch.float32, seed=22,
                                                head_dim=head_dim)  # fmt: skip
    args = (b, qkv, positions, slots, cos_sin, 8, 2)
    got = _run(layer.rotary_store_attend, *args, **attention)
    two_ops = _run(two_ops_of, *args, **attention)
    want = _run(ref.rotary_store_attend, *args, **attention)
    for g, t in zip(got, two_ops, strict=True):
        assert torch.equal(g, t)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
    assert torch.equal(got[2], want[2])
    assert not one_calls
    assert bool(loop_calls) == in_one_call


def test_a_call_without_a_plan_reads_the_positions_it_is_given(one_calls):
    """Called alone (no step's plan), the op reads its metadata itself: positions
    changed in place since the last call are read again."""
    b, qkv, positions, slots, cos_sin = _inputs(LONG_DECODES, 8, 2, torch.bfloat16, seed=23)
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    meta = (slots, b.block_tables, b.seq_lens, b.query_start_loc, b.scale)
    layer.rotary_store_attend(positions, qkv, 8, 2, cos_sin, k_cache, v_cache, *meta)
    positions.add_(1)  # the same tensor, other positions
    got = layer.rotary_store_attend(positions, qkv, 8, 2, cos_sin, k_cache, v_cache, *meta)
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
        layer.rotary_store_attend(positions, qkv, 8, 2, cos_sin, k_cache, v_cache, slots,
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
        layer.rotary_store_attend(positions, qkv, num_heads, 2, cos_sin, b.k_cache, b.v_cache,
                                    slots, b.block_tables, b.seq_lens, b.query_start_loc,
                                    b.scale)  # fmt: skip


def test_every_backend_has_the_op():
    """The torch backend's is the reference; the others compose their own two ops
    where they have no fused one."""
    assert get_ops("torch").rotary_store_attend is ref.rotary_store_attend
    assert get_ops("cpu").rotary_store_attend is layer.rotary_store_attend
    assert get_ops("cpu").attention_layer is layer.CpuAttentionLayer


def test_a_cache_that_is_not_a_tensor_is_named(one_calls):
    b, qkv, positions, slots, cos_sin = _inputs(DECODE, 8, 2, torch.bfloat16, seed=26)
    with pytest.raises(ValueError, match="k_cache"):
        layer.rotary_store_attend(positions, qkv, 8, 2, cos_sin, "cache", b.v_cache, slots,
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
    layer.rotary_store_attend(positions, qkv, 8, 2, cos_sin, k_cache, v_cache, *meta, b.scale)
    scale = attention.pop("scale", b.scale)
    with pytest.raises(ValueError, match=named):
        layer.rotary_store_attend(positions, qkv, 8, 2, cos_sin, k_cache, v_cache, *meta, scale,
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", [{}, {"window": 24}, {"soft_cap": 30.0}])
def test_a_bound_layer_with_the_steps_plan_equals_the_op(one_calls, dtype, attention):
    """A layer bound to its caches at load, called with a step's plan built once
    (as the decoder runs it), equals the op called alone, to the bit."""
    shape = DECODE + LONG_DECODES
    b, qkv, positions, slots, cos_sin = _inputs(shape, 8, 2, dtype, seed=29)
    want = _run(layer.rotary_store_attend, b, qkv, positions, slots, cos_sin, 8, 2, **attention)
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    bound = layer.CpuAttentionLayer(get_ops("cpu"), num_heads=8, num_kv_heads=2, scale=b.scale,
                                    cos_sin=cos_sin, k_cache=k_cache, v_cache=v_cache,
                                    **attention)  # fmt: skip
    meta = AttentionMetadata(positions, slots, b.block_tables, b.seq_lens, b.query_start_loc)
    meta.host = cpu_plan.prepare(meta, num_heads=8, block_size=16, windows=[24])
    got = bound(qkv, meta)
    assert torch.equal(got, want[0]) and torch.equal(k_cache, want[1])
    assert torch.equal(v_cache, want[2])
