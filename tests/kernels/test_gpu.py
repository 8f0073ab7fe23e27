"""Compiled Triton kernels vs the torch references at realistic sizes (needs CUDA).

Run with ``TRITON_INTERPRET= .venv/bin/python -m pytest -m gpu tests/kernels -s``;
``-s`` shows the paged attention bandwidth lines. Tolerances: fp16 atol 2e-3 /
rtol 1e-2, bf16 atol 1e-2 / rtol 1.6e-2, fp32 atol/rtol 1e-5. The same checks,
with the model and the speed figures, run as one script: scripts/gpu_check.py.
"""

import pytest
import torch

from iterserve.kernels import build_cos_sin_cache, get_ops
from iterserve.kernels import reference as ref
from iterserve.kernels.checks import interpreting

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET is set; run compiled kernels"),
]

DEV = "cuda"
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}


@pytest.fixture(scope="module")
def ops():
    ops = get_ops("auto", DEV)
    assert ops.name == "triton"
    return ops


MIXED = [(2047, 1), (1000, 1), (517, 300), (0, 512), (33, 1), (120, 0), (8191, 1), (70, 3)]


def _mixed_batch(num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, shape=MIXED,
                 first_block=0, width=None):  # fmt: skip
    """Decode rows with long contexts plus prefill chunks, one starting mid-block.
    Blocks are numbered from ``first_block`` (a large one puts offsets past 2^31)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q_lens = [q for _, q in shape]
    seq_lens = [c + q for c, q in shape]
    per_seq = [-(-n // block_size) for n in seq_lens]
    used = sum(per_seq) + 8
    num_blocks = first_block + used
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(cache_shape, dtype=dtype, device=DEV)
    v_cache = torch.zeros(cache_shape, dtype=dtype, device=DEV)
    k_cache[first_block:] = torch.randn((used, *cache_shape[1:]), generator=g, device=DEV)
    v_cache[first_block:] = torch.randn((used, *cache_shape[1:]), generator=g, device=DEV)
    perm = first_block + torch.randperm(used, generator=g, device=DEV).to(torch.int32)
    tables = torch.zeros(len(shape), width or max(per_seq), dtype=torch.int32, device=DEV)
    used = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = perm[used : used + n]
        used += n
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g, device=DEV).to(dtype)
    starts = torch.tensor([0] + q_lens, device=DEV).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return query, k_cache, v_cache, tables, lens, starts, head_dim**-0.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 32), (32, 8), (64, 8)])
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (64, 32)])
def test_paged_attention_matches_reference(
    ops, dtype, num_heads, num_kv_heads, head_dim, block_size
):
    args = _mixed_batch(num_heads, num_kv_heads, head_dim, block_size, dtype)
    torch.testing.assert_close(ops.paged_attention(*args), ref.paged_attention(*args), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 1, 5, 64])
@pytest.mark.parametrize(
    "shape",
    [[(8191, 1)], [(1023, 1)], [(c, 1) for c in range(1, 8192, 128)]],
    ids=["1x8k", "1x1k", "64xto8k"],
)
def test_decode_kernel_matches_reference(shape, num_splits, dtype):
    from iterserve.kernels import attention_plan, triton_attention

    args = _mixed_batch(32, 8, 128, 16, dtype, shape=shape)
    if num_splits is None:
        got = triton_attention.paged_attention(*args, max_query_len=1)
    else:
        tiles = attention_plan.tiles_for(args[0].element_size(), 128, 4)
        plan = attention_plan.AttentionPlan(tiles, num_splits, True, False)
        got = triton_attention.run_plan(plan, *args)
    torch.testing.assert_close(got, ref.paged_attention(*args), **TOL[dtype])


def test_decode_graphs_wide_table_matches_reference(ops):
    """What a captured decode step launches: the block table as wide as the
    model's longest sequence, the split count fixed by that width."""
    shape = [(c, 1) for c in (5, 300, 2047, 4000, 1, 64, 65, 8191)]
    args = _mixed_batch(32, 8, 128, 16, torch.bfloat16, shape=shape, width=512)
    got = ops.paged_attention(*args, max_query_len=1, max_seq_len=512 * 16)
    torch.testing.assert_close(got, ref.paged_attention(*args), **TOL[torch.bfloat16])


def test_cache_over_two_billion_elements(ops):
    """Block offsets past 2^31 elements must not wrap (int64 addressing)."""
    per_block = 16 * 8 * 128
    first = (1 << 31) // per_block + 8
    if torch.cuda.mem_get_info()[0] < 24 << 30:
        pytest.skip("needs 24 GiB free")
    args = _mixed_batch(32, 8, 128, 16, torch.bfloat16, shape=[(4000, 1), (100, 200), (8, 1)],
                        first_block=first)  # fmt: skip
    assert args[1].numel() > 2**31
    torch.testing.assert_close(
        ops.paged_attention(*args), ref.paged_attention(*args), **TOL[torch.bfloat16]
    )
    q, k_cache, v_cache = args[:3]
    slots = (first * 16 + torch.randperm(4096, device=DEV)[: q.shape[0]]).to(torch.int32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ops.store_kv(q[:, :8], q[:, :8], k_cache, v_cache, slots)
    ref.store_kv(q[:, :8], q[:, :8], want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_small_ops_match_reference(ops, dtype):
    g = torch.Generator(device=DEV).manual_seed(1)
    tokens, hidden, heads, kv_heads, head_dim = 4096, 4096, 32, 8, 128

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=DEV).to(dtype)

    x, r, w = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), **TOL[dtype])
    got, want = ops.rms_norm(x, w, 1e-5, r), ref.rms_norm(x, w, 1e-5, r)
    torch.testing.assert_close(got[0], want[0], **TOL[dtype])
    torch.testing.assert_close(got[1], want[1], **TOL[dtype])

    gate_up = randn(tokens, 2 * 14336)
    torch.testing.assert_close(ops.silu_mul(gate_up), ref.silu_mul(gate_up), **TOL[dtype])

    cache = build_cos_sin_cache(head_dim, 8192, 500000.0).to(DEV)
    positions = torch.randint(0, 8192, (tokens,), generator=g, device=DEV)
    qkv = randn(tokens, heads + 2 * kv_heads, head_dim)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    for a, b in zip(
        ops.rotary_embedding(positions, q, k, cache),
        ref.rotary_embedding(positions, q, k, cache),
        strict=True,
    ):
        torch.testing.assert_close(a, b, **TOL[dtype])

    k_caches = [torch.zeros(600, 16, kv_heads, head_dim, dtype=dtype, device=DEV) for _ in range(2)]
    v_caches = [torch.zeros_like(c) for c in k_caches]
    slots = torch.randperm(600 * 16, generator=g, device=DEV)[:tokens]
    slots[::7] = -1
    value = qkv[:, heads + kv_heads :]
    ops.store_kv(k, value, k_caches[0], v_caches[0], slots)
    ref.store_kv(k, value, k_caches[1], v_caches[1], slots)
    assert torch.equal(k_caches[0], k_caches[1]) and torch.equal(v_caches[0], v_caches[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window,soft_cap", [(4096, None), (1000, 50.0), (100, None)])
def test_windowed_and_capped_attention_matches_reference(ops, dtype, window, soft_cap):
    args = _mixed_batch(32, 16, 256, 16, dtype)  # Gemma 2's 256-wide heads
    kw = dict(window=window, soft_cap=soft_cap)
    torch.testing.assert_close(ops.paged_attention(*args, **kw),
                               ref.paged_attention(*args, **kw), **TOL[dtype])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_grouped_experts_match_reference(ops, dtype, num_tokens):
    """Qwen3-30B-A3B's layer: 128 experts of 768, eight a token."""
    from iterserve.kernels import experts

    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(num_tokens, 2048, generator=g, device=DEV).to(dtype)
    w13 = (torch.randn(128, 1536, 2048, generator=g, device=DEV) / 45).to(dtype)
    w2 = (torch.randn(128, 2048, 768, generator=g, device=DEV) / 28).to(dtype)
    logits = torch.randn(num_tokens, 128, generator=g, device=DEV)
    weights, ids = experts.route(logits, 8, True)
    got = ops.fused_experts(x, w13, w2, ids, weights)
    torch.testing.assert_close(got, experts.fused_experts(x, w13, w2, ids, weights), **TOL[dtype])


@pytest.mark.parametrize(
    "num_seqs,context_len,num_heads,num_kv_heads",
    [(8, 4096, 32, 8), (64, 2048, 32, 8), (256, 1024, 32, 8), (64, 2048, 32, 32)],
)
def test_paged_attention_bandwidth(num_seqs, context_len, num_heads, num_kv_heads):
    from iterserve.kernels.bench import bench_attention_bandwidth

    result = bench_attention_bandwidth(
        num_seqs=num_seqs,
        context_len=context_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=128,
        block_size=16,
        dtype=torch.float16,
    )
    print(f"\n{result}")
    assert result.time_ms > 0 and result.gbytes_per_s > 0
