"""rms_norm, rotary_embedding, silu_mul and gelu_tanh_mul: references vs Hugging Face / naive math,
Triton vs references (interpreted on CPU).

Tolerances: fp32 atol/rtol 1e-5; fp16 atol 2e-3, rtol 1e-2. The references are
expected to match Hugging Face Llama bit for bit where they do the same math.
"""

import pytest
import torch

from iterserve.kernels import build_cos_sin_cache
from iterserve.kernels import reference as ref

triton_ops = pytest.importorskip("iterserve.kernels.triton_ops")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=1e-2)}


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# ----------------------------------------------------------------------- rms_norm


def hf_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm.forward, written out."""
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_rms_norm_matches_hf(dtype):
    x = randn(6, 96, dtype=dtype, scale=3.0).cpu()
    w = randn(96, dtype=dtype, seed=1).cpu()
    r = randn(6, 96, dtype=dtype, seed=2).cpu()
    assert torch.equal(ref.rms_norm(x, w, 1e-6), hf_rms_norm(x, w, 1e-6))
    out, res = ref.rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(res, x + r)
    assert torch.equal(out, hf_rms_norm(x + r, w, 1e-6))


def test_reference_rms_norm_matches_transformers_module():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    norm = llama.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x = randn(5, 64, scale=2.0).cpu()
    with torch.no_grad():
        assert torch.equal(ref.rms_norm(x, norm.weight, 1e-5), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_rms_norm(dtype, hidden, with_residual):
    # x as a row-strided view (every other row of a bigger buffer)
    x = randn(14, hidden, dtype=dtype, scale=2.0)[::2]
    w = randn(hidden, dtype=dtype, seed=1)
    r = randn(7, hidden, dtype=dtype, seed=2) if with_residual else None
    x_before = x.clone()
    got = triton_ops.rms_norm(x, w, 1e-6, residual=r)
    want = ref.rms_norm(x, w, 1e-6, residual=r)
    if with_residual:
        torch.testing.assert_close(got[0], want[0], **TOL[dtype])
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
    else:
        torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(x, x_before)


# ---------------------------------------------------------------------- rotary


def hf_rotary(positions, query, key, head_dim, base, scaling=None):
    """transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb on [tokens, heads, dim]."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": base, **(scaling or {})}
    cfg = LlamaConfig(
        hidden_size=head_dim * query.shape[1],
        num_attention_heads=query.shape[1],
        num_key_value_heads=key.shape[1],
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters=rope,
    )
    emb = llama.LlamaRotaryEmbedding(cfg)
    cos, sin = emb(query, positions[None])  # [1, tokens, head_dim]
    # HF wants [batch, heads, tokens, dim]
    q, k = llama.apply_rotary_pos_emb(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin
    )
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_reference_rotary_matches_hf(scaling):
    head_dim, base = 64, 500000.0
    positions = torch.tensor([0, 1, 7, 300, 2000, 4095])
    q = randn(6, 4, head_dim).cpu()
    k = randn(6, 2, head_dim, seed=1).cpu()
    cache = build_cos_sin_cache(head_dim, 4096, base, scaling)
    got_q, got_k = ref.rotary_embedding(positions, q, k, cache)
    want_q, want_k = hf_rotary(positions, q, k, head_dim, base, scaling)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
def test_triton_rotary(dtype, head_dim, num_heads, num_kv_heads):
    num_tokens = 9
    positions = torch.tensor([0, 5, 5, 17, 31, 32, 100, 511, 3], device=DEVICE)
    cache = build_cos_sin_cache(head_dim, 512, 10000.0, LLAMA3).to(DEVICE)
    # query / key as strided views of one fused projection output
    qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    before = qkv.clone()
    got_q, got_k = triton_ops.rotary_embedding(positions, q, k, cache)
    want_q, want_k = ref.rotary_embedding(positions, q, k, cache)
    assert got_q.dtype == dtype and got_q.shape == q.shape and got_k.shape == k.shape
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert torch.equal(qkv, before), "inputs must not be modified"


# ---------------------------------------------------------------------- silu_mul


def test_reference_silu_mul_matches_naive():
    x = randn(5, 2 * 48, scale=4.0).cpu()
    gate, up = x[:, :48], x[:, 48:]
    want = gate * (1 / (1 + torch.exp(-gate))) * up
    torch.testing.assert_close(ref.silu_mul(x), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [48, 100, 1500])
def test_triton_silu_mul(dtype, d):
    x = randn(6, 2 * d, dtype=dtype, scale=4.0)
    got = triton_ops.silu_mul(x)
    assert got.shape == (6, d) and got.dtype == dtype
    torch.testing.assert_close(got, ref.silu_mul(x), **TOL[dtype])


def test_reference_gelu_tanh_mul_matches_transformers_activation():
    from transformers.activations import ACT2FN

    x = randn(5, 2 * 48, scale=4.0).cpu()
    want = ACT2FN["gelu_pytorch_tanh"](x[:, :48]) * x[:, 48:]
    torch.testing.assert_close(ref.gelu_tanh_mul(x), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [48, 1500])
def test_triton_gelu_tanh_mul(dtype, d):
    x = randn(6, 2 * d, dtype=dtype, scale=4.0)
    got = triton_ops.gelu_tanh_mul(x)
    assert got.shape == (6, d) and got.dtype == dtype
    torch.testing.assert_close(got, ref.gelu_tanh_mul(x), **TOL[dtype])


def test_triton_ops_accept_empty_batches():
    cache = build_cos_sin_cache(64, 16, 10000.0).to(DEVICE)
    empty = torch.empty(0, 2, 64, device=DEVICE)
    positions = torch.empty(0, dtype=torch.int64, device=DEVICE)
    q, k = triton_ops.rotary_embedding(positions, empty, empty, cache)
    assert q.shape == (0, 2, 64) and k.shape == (0, 2, 64)
    assert triton_ops.silu_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)
    w = torch.ones(8, device=DEVICE)
    assert triton_ops.rms_norm(torch.empty(0, 8, device=DEVICE), w, 1e-6).shape == (0, 8)
