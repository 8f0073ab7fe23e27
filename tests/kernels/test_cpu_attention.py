"""The cpu backend's compiled decode attention equals dense attention, in fp32 and
on bf16 caches, and the reference's output wherever it does not apply."""

import pytest
import torch

from iterserve.kernels import cpu_attention, cpu_ops, get_ops
from iterserve.kernels import reference as ref
from tests.kernels.attention_cases import DECODE, MIXED, dense_attention, make_batch

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="numba is not installed")

# Decode rows with contexts inside one block, across many, at a block's edge.
LONG_DECODES = [(0, 1), (15, 1), (16, 1), (300, 1), (47, 1), (129, 1)]


def on_cpu(b):
    for name in ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"):
        setattr(b, name, getattr(b, name).cpu())
    return b


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("shape", [MIXED, DECODE, LONG_DECODES], ids=["mixed", "decode", "long"])
def test_cpu_attention_matches_dense(block_size, num_heads, num_kv_heads, shape):
    b = on_cpu(make_batch(shape, num_heads, num_kv_heads, 64, block_size, torch.float32))
    got = cpu_attention.paged_attention(*b.args())
    torch.testing.assert_close(got.double(), dense_attention(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("filler", [-1, 0])
def test_cpu_attention_reads_no_table_column_past_a_sequence(filler):
    b = on_cpu(make_batch(DECODE, 8, 2, 64, 4, torch.float32))
    for s, n in enumerate(b.seq_lens.tolist()):
        b.block_tables[s, -(-n // 4) :] = filler
    got = cpu_attention.paged_attention(*b.args())
    torch.testing.assert_close(got.double(), dense_attention(b), atol=1e-5, rtol=1e-5)


def test_cpu_attention_takes_a_strided_query():
    b = on_cpu(make_batch(MIXED, 4, 2, 64, 16, torch.float32, seed=3))
    wide = torch.randn(b.query.shape[0], 8, 64)
    wide[:, 2:6] = b.query
    b.query = wide[:, 2:6]  # a view, as the attention input is a slice of the qkv output
    assert not b.query.is_contiguous()
    got = cpu_attention.paged_attention(*b.args())
    torch.testing.assert_close(got.double(), dense_attention(b), atol=1e-5, rtol=1e-5)


def serial_and_parallel(b):
    """The batch attended with one torch thread, then with two."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = cpu_attention.paged_attention(*b.args())
        torch.set_num_threads(2)
        return serial, cpu_attention.paged_attention(*b.args())
    finally:
        torch.set_num_threads(threads)


def test_threads_split_the_sequences_with_the_same_results():
    """To rounding: the serial and the parallel loop are compiled apart, and fastmath
    lets each vectorize its sums its own way."""
    b = on_cpu(make_batch(LONG_DECODES * 3, 8, 2, 64, 16, torch.float32, seed=4))
    serial, parallel = serial_and_parallel(b)
    torch.testing.assert_close(parallel, serial, atol=1e-6, rtol=1e-6)


# A bf16 result is the fp32 one rounded once; sums in another order can move the
# fp32 value across a rounding boundary: one bf16 step, 2**-8 to 2**-7 of the value.
BF16_STEP = dict(atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("shape", [MIXED, DECODE, LONG_DECODES], ids=["mixed", "decode", "long"])
def test_bf16_cache_is_attended_as_the_dense_attention_of_its_values(num_heads, num_kv_heads,
                                                                     shape):  # fmt: skip
    """The kernel reads bf16 K/V and query as the exact fp32 values they hold, keeps
    its sums in fp32 and rounds the output once, as the reference does."""
    b = on_cpu(make_batch(shape, num_heads, num_kv_heads, 64, 16, torch.bfloat16, seed=9))
    got = cpu_attention.paged_attention(*b.args())
    assert got.dtype == torch.bfloat16
    want = dense_attention(b)  # the same bf16 values, in fp64
    torch.testing.assert_close(got.double(), want.to(torch.bfloat16).double(), **BF16_STEP)
    torch.testing.assert_close(got, ref.paged_attention(*b.args()), **BF16_STEP)


def test_bf16_rows_split_across_threads_alike():
    b = on_cpu(make_batch(LONG_DECODES * 3, 8, 2, 64, 16, torch.bfloat16, seed=10))
    serial, parallel = serial_and_parallel(b)
    torch.testing.assert_close(parallel, serial, **BF16_STEP)


def test_fp16_takes_the_reference_path():
    b = on_cpu(make_batch(DECODE, 4, 2, 64, 16, torch.float16, seed=5))
    assert torch.equal(cpu_attention.paged_attention(*b.args()), ref.paged_attention(*b.args()))


def test_cpu_backend_compiles_every_op():
    cpu = get_ops("cpu")
    assert cpu.name == "cpu" and cpu.paged_attention is cpu_attention.paged_attention
    assert (cpu.store_kv, cpu.rms_norm, cpu.rotary_embedding, cpu.silu_mul) == (
        cpu_ops.store_kv, cpu_ops.rms_norm, cpu_ops.rotary_embedding, cpu_ops.silu_mul,
    )  # fmt: skip
    assert get_ops("auto", device="cpu").name == "cpu"


# Prefill pieces: one under a block, several blocks, one whose context is cached.
PIECES = [(0, 5), (0, 40), (24, 9), (3, 1), (0, 70)]


@pytest.mark.parametrize("short_work", [0, 1 << 16], ids=["flash", "kernel"])
def test_prefill_pieces_match_dense_on_either_path(monkeypatch, short_work):
    """Pieces at most SHORT_PIECE_WORK rows x positions x heads run on the kernel, longer
    ones on torch's flash attention, with or without cached context: both are
    exact causal attention."""
    monkeypatch.setattr(cpu_attention, "SHORT_PIECE_WORK", short_work)
    b = on_cpu(make_batch(PIECES, 8, 2, 64, 16, torch.float32, seed=6))
    got = cpu_attention.paged_attention(*b.args())
    torch.testing.assert_close(got.double(), dense_attention(b), atol=1e-5, rtol=1e-5)


# torch's flash attention rounds the softmax weights to bf16 before they multiply V
# (as transformers' bf16 attention does): an output's error is then a bf16 step of
# the largest values it sums (|V| ~ 1 here), not of itself.
FLASH_BF16 = dict(atol=2**-7, rtol=2**-7)


@pytest.mark.parametrize("short_work", [0, 1 << 16], ids=["flash", "kernel"])
def test_bf16_prefill_pieces_match_dense_on_either_path(monkeypatch, short_work):
    monkeypatch.setattr(cpu_attention, "SHORT_PIECE_WORK", short_work)
    b = on_cpu(make_batch(PIECES, 8, 2, 64, 16, torch.bfloat16, seed=11))
    got = cpu_attention.paged_attention(*b.args())
    assert got.dtype == torch.bfloat16
    want = dense_attention(b).to(torch.bfloat16).double()
    torch.testing.assert_close(got.double(), want, **(FLASH_BF16 if short_work == 0 else BF16_STEP))


def test_prefill_pieces_split_across_threads_alike():
    b = on_cpu(make_batch(PIECES * 2, 4, 2, 64, 16, torch.float32, seed=7))
    serial, parallel = serial_and_parallel(b)
    torch.testing.assert_close(parallel, serial, atol=1e-6, rtol=1e-6)


def test_the_layers_of_one_batch_share_its_plan_until_its_metadata_changes(monkeypatch):
    """The lengths are read once per batch, not once per layer; a table written in
    place (as a replayed graph's static inputs are) is read again."""
    splits = []
    split = ref.split_pieces
    monkeypatch.setattr(ref, "split_pieces", lambda *a, **k: splits.append(1) or split(*a, **k))
    b = on_cpu(make_batch(MIXED, 4, 2, 64, 16, torch.float32, seed=8))
    first = cpu_attention.paged_attention(*b.args())
    assert torch.equal(cpu_attention.paged_attention(*b.args()), first)
    assert len(splits) == 1
    b.seq_lens[0] -= 1  # one position fewer for the first decode row
    changed = cpu_attention.paged_attention(*b.args())
    assert len(splits) == 2
    torch.testing.assert_close(changed, ref.paged_attention(*b.args()), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(changed, first, atol=1e-3)
