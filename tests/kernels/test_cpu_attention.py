"""The cpu backend's compiled decode attention equals dense attention, and the
reference's output wherever it does not apply."""

import pytest
import torch

from iterserve.kernels import cpu_attention, get_ops
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


def test_threads_split_the_sequences_with_the_same_results():
    """To rounding: the serial and the parallel loop are compiled apart, and fastmath
    lets each vectorize its sums its own way."""
    b = on_cpu(make_batch(LONG_DECODES * 3, 8, 2, 64, 16, torch.float32, seed=4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = cpu_attention.paged_attention(*b.args())
        torch.set_num_threads(2)
        parallel = cpu_attention.paged_attention(*b.args())
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(parallel, serial, atol=1e-6, rtol=1e-6)


def test_fp16_takes_the_reference_path():
    b = on_cpu(make_batch(DECODE, 4, 2, 64, 16, torch.float16, seed=5))
    assert torch.equal(cpu_attention.paged_attention(*b.args()), ref.paged_attention(*b.args()))


def test_cpu_backend_shares_the_reference_ops():
    cpu, torch_ops = get_ops("cpu"), get_ops("torch")
    assert cpu.name == "cpu" and cpu.paged_attention is cpu_attention.paged_attention
    assert cpu.store_kv is torch_ops.store_kv and cpu.rms_norm is torch_ops.rms_norm
    assert get_ops("auto", device="cpu").name == "cpu"
