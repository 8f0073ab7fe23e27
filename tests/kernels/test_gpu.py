"""Compiled Triton kernels vs the torch references at realistic sizes (needs CUDA).

Run with ``TRITON_INTERPRET= .venv/bin/python -m pytest -m gpu tests/kernels -s``;
``-s`` shows the paged attention bandwidth lines. Tolerances: fp16 atol 2e-3 /
rtol 1e-2, bf16 atol 1e-2 / rtol 1.6e-2, fp32 atol/rtol 1e-5.
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


def _mixed_batch(num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Decode rows with long contexts plus two prefill chunks, one starting mid-block."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    shape = [(2047, 1), (1000, 1), (517, 300), (0, 512), (33, 1), (120, 0), (4000, 1)]
    q_lens = [q for _, q in shape]
    seq_lens = [c + q for c, q in shape]
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 8
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=g, device=DEV).to(dtype)
    v_cache = torch.randn(cache_shape, generator=g, device=DEV).to(dtype)
    perm = torch.randperm(num_blocks, generator=g, device=DEV).to(torch.int32)
    tables = torch.zeros(len(shape), max(per_seq), dtype=torch.int32, device=DEV)
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
