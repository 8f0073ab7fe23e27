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
        compute_inv_freq(64, 10000.0, {"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        compute_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        compute_inv_freq(64, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="head_dim"):
        compute_inv_freq(63, 10000.0)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize(
    "scaling",
    [
        YARN,
        {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        {**YARN, "attention_factor": 1.25},
    ],
)
def test_yarn_matches_transformers(scaling):
    """Qwen3 ships YaRN: inverse frequencies and the attention factor folded into cos/sin."""
    from transformers.models.qwen3 import modeling_qwen3

    cfg = transformers.Qwen3Config(
        hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=1024,
        rope_parameters={"rope_theta": 1000000.0, **scaling},
    )  # fmt: skip
    emb = modeling_qwen3.Qwen3RotaryEmbedding(cfg)
    check_table(emb, 64, 1000000.0, scaling, 1024)


def test_longrope_short_factors_and_partial_rotary_match_phi3():
    """Phi-3.5 / Phi-4-mini: longrope (short factors, while a sequence stays within the
    original context) over the first 3/4 of each head."""
    from transformers.models.phi3 import modeling_phi3

    gen = torch.Generator().manual_seed(0)
    short = (1 + torch.rand(12, generator=gen)).tolist()
    long = (2 + torch.rand(12, generator=gen)).tolist()
    cfg = transformers.Phi3Config(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=4096,
        original_max_position_embeddings=512,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                         "long_factor": long, "partial_rotary_factor": 0.75},
    )  # fmt: skip
    emb = modeling_phi3.Phi3RotaryEmbedding(cfg)
    ours = {"rope_type": "longrope", "short_factor": short, "factor": 8.0,
            "original_max_position_embeddings": 512}  # fmt: skip
    check_table(emb, 24, 10000.0, ours, 512)


def check_table(emb, rotary_dim, base, scaling, num_positions):
    assert torch.equal(compute_inv_freq(rotary_dim, base, scaling), emb.inv_freq)
    cache = build_cos_sin_cache(rotary_dim, num_positions, base, scaling)
    cos, sin = emb(torch.zeros(1, 1, rotary_dim), torch.arange(num_positions)[None])
    half = rotary_dim // 2
    torch.testing.assert_close(cache[:, :half], cos[0, :, :half], atol=0, rtol=0)
    torch.testing.assert_close(cache[:, half:], sin[0, :, :half], atol=0, rtol=0)
