"""build_cos_sin_cache / compute_inv_freq reproduce transformers' Llama rotary tables exactly."""

import pytest
import torch

from iterserve.kernels import build_cos_sin_cache, compute_inv_freq

llama = pytest.importorskip("transformers.models.llama.modeling_llama")
transformers = pytest.importorskip("transformers")

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def hf_rotary(head_dim, base, scaling):
    cfg = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": base, **(scaling or {})},
    )
    return llama.LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize(
    "head_dim,base,scaling",
    [
        (64, 10000.0, None),
        (128, 500000.0, None),
        (128, 500000.0, LLAMA3),
        (64, 500000.0, {**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 512}),
    ],
)
def test_matches_transformers(head_dim, base, scaling):
    emb = hf_rotary(head_dim, base, scaling)
    assert torch.equal(compute_inv_freq(head_dim, base, scaling), emb.inv_freq)
    max_position = 20000
    cache = build_cos_sin_cache(head_dim, max_position, base, scaling)
    assert cache.shape == (max_position, head_dim) and cache.dtype == torch.float32
    cos, sin = emb(torch.zeros(1, 1, head_dim), torch.arange(max_position)[None])
    half = head_dim // 2
    torch.testing.assert_close(cache[:, :half], cos[0, :, :half], atol=0, rtol=0)
    torch.testing.assert_close(cache[:, half:], sin[0, :, :half], atol=0, rtol=0)


def test_scaling_variants():
    plain = compute_inv_freq(64, 10000.0)
    # legacy "type" key and an explicit default type
    assert torch.equal(compute_inv_freq(64, 10000.0, {"type": "default"}), plain)
    assert torch.equal(
        compute_inv_freq(64, 10000.0, {"rope_type": "linear", "factor": 4.0}), plain / 4
    )
    assert build_cos_sin_cache(64, 8, 10000.0, dtype=torch.float16).dtype == torch.float16
    with pytest.raises(ValueError, match="rope_type"):
        compute_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        compute_inv_freq(64, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="head_dim"):
        compute_inv_freq(63, 10000.0)
