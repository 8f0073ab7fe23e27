"""store_kv and paged_attention: references vs naive dense math, Triton vs references.

On a machine without CUDA the Triton kernels run in the interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before this module is imported), so
shapes are kept tiny. Tolerances: fp32 atol/rtol 1e-5; fp16 atol 2e-3, rtol 1e-2
(fp16 output rounding plus fp16 probabilities in the P @ V product).
"""

import dataclasses

import pytest
import torch

from iterserve.kernels import attention_plan
from iterserve.kernels import reference as ref
from tests.kernels.attention_cases import (
    DECODE,
    DEVICE,
    MIXED,
    TOL,
    Batch,
    dense_attention,
    make_batch,
)

triton_attention = pytest.importorskip("iterserve.kernels.triton_attention")
triton_cache = pytest.importorskip("iterserve.kernels.triton_cache")

# -------------------------------------------------------------------- references


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["mixed", "decode"])
def test_reference_attention_matches_dense(block_size, num_heads, num_kv_heads, shape):
    b = make_batch(shape, num_heads, num_kv_heads, 64, block_size, torch.float32)
    got = ref.paged_attention(*b.args())
    torch.testing.assert_close(got.double().cpu(), dense_attention(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("filler", [-1, 0])
def test_reference_decodes_ignore_table_columns_past_their_length(filler):
    # Decode rows are attended together over a table padded to the longest sequence:
    # what a shorter sequence's unused columns hold (a dangling -1, another
    # sequence's block) must not reach its output.
    b = make_batch(DECODE, 8, 2, 64, 4, torch.float32)
    for s, n in enumerate(b.seq_lens.tolist()):
        b.block_tables[s, -(-n // 4) :] = filler
    got = ref.paged_attention(*b.args())
    torch.testing.assert_close(got.double().cpu(), dense_attention(b), atol=1e-5, rtol=1e-5)


def test_reference_attention_chunks_long_queries(monkeypatch):
    monkeypatch.setattr(ref, "_ATTN_QUERY_CHUNK", 5)
    b = make_batch(MIXED, 4, 2, 64, 16, torch.float32)
    torch.testing.assert_close(
        ref.paged_attention(*b.args()).double().cpu(), dense_attention(b), atol=1e-5, rtol=1e-5
    )


def test_reference_store_kv_matches_loop():
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(2, 7, 2, 8, generator=g)
    slots = torch.tensor([0, 15, -1, 16, 63, -1, 33])
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros(4, 16, 2, 8)
    ref.store_kv(key, value, k_cache, v_cache, slots)
    k_want, v_want = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_want[slot // 16, slot % 16] = key[t]
            v_want[slot // 16, slot % 16] = value[t]
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


def test_reference_rejects_bad_metadata():
    b = make_batch(MIXED, 2, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="seq_lens"):
        ref.paged_attention(*b.args()[:4], b.seq_lens - 5, *b.args()[5:])
    with pytest.raises(ValueError, match="query_start_loc"):
        ref.paged_attention(*b.args()[:5], b.query_start_loc + 1, b.scale)
    with pytest.raises(ValueError, match="slot_mapping"):
        ref.store_kv(b.query[:1, :2], b.query[:1, :2], b.k_cache, b.v_cache, torch.tensor([10**6]))


# ------------------------------------------------------------------------- triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_attention_mixed_batch(block_size, num_heads, num_kv_heads, head_dim, dtype):
    b = make_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype)
    got = triton_attention.paged_attention(*b.args())
    assert got.dtype == dtype and got.shape == b.query.shape
    torch.testing.assert_close(got, ref.paged_attention(*b.args()), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_triton_attention_decode_batch(num_heads, num_kv_heads, dtype):
    b = make_batch(DECODE, num_heads, num_kv_heads, 64, 16, dtype, seed=3)
    torch.testing.assert_close(
        triton_attention.paged_attention(*b.args()), ref.paged_attention(*b.args()), **TOL[dtype]
    )


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (64, 32)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 1)])
def test_triton_attention_tile_sizes(block_m, block_n, num_heads, num_kv_heads):
    """Small tiles: several KV tiles per row (online softmax) and query blocks per piece."""
    b = make_batch(MIXED, num_heads, num_kv_heads, 64, 16, torch.float32, seed=5)
    got = triton_attention.paged_attention_launch(*b.args(), block_m=block_m, block_n=block_n)
    torch.testing.assert_close(got, ref.paged_attention(*b.args()), **TOL[torch.float32])


def test_triton_attention_strided_query_and_empty_batch():
    b = make_batch(MIXED, 4, 2, 64, 16, torch.float32, seed=7)
    # query as a view into a fused [num_tokens, q | k | v] projection output
    fused = torch.randn(b.query.shape[0], 8, 64, device=DEVICE)
    fused[:, :4] = b.query
    b.query = fused[:, :4]
    assert not b.query.is_contiguous()
    torch.testing.assert_close(
        triton_attention.paged_attention(*b.args()),
        ref.paged_attention(*b.args()),
        atol=1e-5,
        rtol=1e-5,
    )
    empty = make_batch([(4, 0), (20, 0)], 4, 2, 64, 16, torch.float32)
    assert triton_attention.paged_attention(*empty.args()).shape == (0, 4, 64)
    assert ref.paged_attention(*empty.args()).shape == (0, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_store_kv_matches_reference(block_size, dtype):
    g = torch.Generator().manual_seed(2)
    num_tokens, num_kv_heads, head_dim, num_blocks = 11, 2, 64, 3
    # key/value as strided views of one fused buffer, as after a qkv projection
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 7]] = -1  # padding rows
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, 7.0, dtype=dtype, device=DEVICE) for _ in range(4)]
    ref.store_kv(key, value, caches[0], caches[1], slots)
    triton_cache.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int((caches[2] != 7.0).any(-1).any(-1).sum()) == num_tokens - 2


def test_chunked_prefill_then_decode_through_store_kv():
    """Feed one sequence as chunks (the second starts mid-block), then decode."""
    g = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads, head_dim, block_size, total = 4, 2, 64, 16, 30
    q = torch.randn(total, num_heads, head_dim, generator=g)
    k = torch.randn(total, num_kv_heads, head_dim, generator=g)
    v = torch.randn(total, num_kv_heads, head_dim, generator=g)
    k_cache = torch.zeros(4, block_size, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[3, 0, 2]], dtype=torch.int32, device=DEVICE)
    dense = Batch(q, None, None, None, None, None, [k], [v], [total], head_dim**-0.5)
    want = dense_attention(dense).float()
    for start, end in [(0, 11), (11, 29), (29, 30)]:
        pos = torch.arange(start, end)
        slots = (table[0].cpu().long()[pos // block_size] * block_size + pos % block_size).to(
            DEVICE
        )
        triton_cache.store_kv(
            k[start:end].to(DEVICE), v[start:end].to(DEVICE), k_cache, v_cache, slots
        )
        args = (
            q[start:end].to(DEVICE),
            k_cache,
            v_cache,
            table,
            torch.tensor([end], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE),
            head_dim**-0.5,
        )
        got = triton_attention.paged_attention(*args)
        torch.testing.assert_close(got.cpu(), want[start:end], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------ split-KV decode

# Contexts on both sides of the 64-position tile edges and the split edges, a
# sequence whose only position is this step's row, and a three-row piece.
EDGES = [(63, 1), (64, 1), (65, 1), (0, 1), (127, 1), (128, 1), (300, 1), (10, 3)]


def decode_plan(num_heads, num_kv_heads, num_splits, *, prefill=False):
    tiles = attention_plan.tiles_for(2, 64, num_heads // num_kv_heads)
    return attention_plan.AttentionPlan(
        tiles=dataclasses.replace(tiles, decode_block_n=64),
        num_splits=num_splits,
        use_decode=True,
        use_prefill=prefill,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_triton_decode_splits_match_reference(num_heads, num_kv_heads, num_splits, dtype):
    b = make_batch(EDGES, num_heads, num_kv_heads, 64, 16, dtype, seed=11)
    # With 8 query heads per KV head a tile holds two rows: the three-row piece
    # goes to the prefill kernel.
    plan = decode_plan(num_heads, num_kv_heads, num_splits, prefill=num_heads // num_kv_heads > 4)
    got = triton_attention.run_plan(plan, *b.args())
    torch.testing.assert_close(got, ref.paged_attention(*b.args()), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [None, 40])
def test_triton_decode_long_single_sequence(num_splits, dtype):
    """One sequence at 2k context: the plan splits it 8 ways; 40 splits leaves
    most of them empty (split_len rounds up to whole tiles)."""
    b = make_batch([(2047, 1)], 8, 2, 32, 16, dtype, seed=12)
    if num_splits is None:
        got = triton_attention.paged_attention(*b.args(), max_query_len=1)
    else:
        got = triton_attention.run_plan(decode_plan(8, 2, num_splits), *b.args())
    torch.testing.assert_close(got, ref.paged_attention(*b.args()), **TOL[dtype])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_mixed_batch_uses_both_kernels(num_heads, num_kv_heads, num_splits):
    """Decode rows and short pieces in the decode kernel, long pieces in the
    prefill kernel, each row written once."""
    shape = MIXED + [(70, 2), (200, 1)]
    b = make_batch(shape, num_heads, num_kv_heads, 64, 16, torch.float32, seed=13)
    plan = decode_plan(num_heads, num_kv_heads, num_splits, prefill=True)
    got = triton_attention.run_plan(plan, *b.args())
    torch.testing.assert_close(got, ref.paged_attention(*b.args()), **TOL[torch.float32])
    # The default dispatch makes the same split from shapes (and the hint) alone.
    got = triton_attention.paged_attention(*b.args(), max_query_len=19)
    torch.testing.assert_close(got, ref.paged_attention(*b.args()), **TOL[torch.float32])


def test_triton_decode_with_a_fixed_wide_block_table():
    """A CUDA graph's block table is as wide as the longest sequence the model
    takes; the splits follow each sequence's own length, not the width."""
    b = make_batch(DECODE, 8, 2, 64, 16, torch.float32, seed=14)
    wide = torch.zeros(b.block_tables.shape[0], 64, dtype=torch.int32, device=DEVICE)
    wide[:, : b.block_tables.shape[1]] = b.block_tables
    b.block_tables = wide
    got = triton_attention.paged_attention(*b.args(), max_query_len=1, max_seq_len=64 * 16)
    torch.testing.assert_close(got, ref.paged_attention(*b.args()), **TOL[torch.float32])


# ------------------------------------------------------------------ the plan


def test_plan_splits_small_decode_batches_only():
    llama8b = dict(num_heads=32, num_kv_heads=8, head_dim=128, num_sms=132)
    one = attention_plan.plan_attention(
        num_tokens=1, num_seqs=1, max_seq_len=8192, max_query_len=1, **llama8b
    )
    assert one.use_decode and not one.use_prefill
    assert one.num_splits == 32
    assert (one.tiles.decode_block_m, one.tiles.decode_block_q, one.tiles.decode_block_n) == (
        16,
        4,
        64,
    )
    wide = attention_plan.plan_attention(
        num_tokens=64, num_seqs=64, max_seq_len=8192, max_query_len=1, **llama8b
    )
    assert wide.num_splits == 1 and not wide.use_prefill
    short = attention_plan.plan_attention(
        num_tokens=1, num_seqs=1, max_seq_len=100, max_query_len=1, **llama8b
    )
    assert short.num_splits == 1  # a split reads at least MIN_SPLIT_LEN positions


def test_plan_sends_long_pieces_to_the_prefill_kernel():
    kw = dict(num_heads=32, num_kv_heads=8, head_dim=128, max_seq_len=4096)
    mixed = attention_plan.plan_attention(num_tokens=600, num_seqs=9, **kw)
    assert mixed.use_decode and mixed.use_prefill and mixed.tiles.prefill_block_m == 64
    # Without the hint the longest piece is bounded by num_tokens; with it,
    # a batch of three-row pieces needs no prefill launch.
    pieces = attention_plan.plan_attention(num_tokens=12, num_seqs=4, max_query_len=3, **kw)
    assert pieces.use_decode and not pieces.use_prefill
    prefill = attention_plan.plan_attention(num_tokens=512, num_seqs=1, **kw)
    assert prefill.use_prefill and not prefill.use_decode and prefill.num_splits == 1
    gqa16 = attention_plan.plan_attention(
        num_tokens=2, num_seqs=2, num_heads=32, num_kv_heads=2, head_dim=64, max_seq_len=64
    )
    assert (gqa16.tiles.decode_block_m, gqa16.tiles.decode_block_q) == (16, 1)
    assert gqa16.tiles.decode_block_n == 128  # 16-bit K/V tiles of 16 KB
    fp32 = attention_plan.tiles_for(4, 128, 4)
    assert (fp32.prefill_block_m, fp32.prefill_block_n, fp32.decode_num_warps) == (32, 32, 8)
