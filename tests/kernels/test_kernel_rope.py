"""build_cos_sin_cache / compute_inv_freq reproduce transformers' Llama rotary tables exactly."""

import pytest
import torch

from iterserve.kernels import build_cos_sin_cache, compute_inv_freq
from iterserve.kernels.rope import uses_long_factors

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


def phi3_longrope():
    """transformers' Phi-3 rotary embedding (longrope over 3/4 of each head, 512
    original positions stretched to 4096) and the scaling our config gives it."""
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
    ours = {"rope_type": "longrope", "short_factor": short, "long_factor": long, "factor": 8.0,
            "original_max_position_embeddings": 512}  # fmt: skip
    return modeling_phi3.Phi3RotaryEmbedding(cfg), ours


@pytest.mark.parametrize("max_model_len", [None, 100, 512])
def test_longrope_short_factors_and_partial_rotary_match_phi3(max_model_len):
    """Phi-3.5 / Phi-4-mini: longrope over the first 3/4 of each head. Served within
    the original context, a table takes the short factors, as transformers does for
    a sequence that stays there."""
    emb, ours = phi3_longrope()
    assert not uses_long_factors(ours, max_model_len)
    check_table(emb, 24, 10000.0, ours, 512, max_model_len=max_model_len)


@pytest.mark.parametrize("max_model_len", [513, 4096])
def test_longrope_long_factors_match_phi3_past_the_original_context(max_model_len):
    """Served past the original context, the table takes the long factors for every
    position: transformers' numbers for a sequence longer than the original (it
    switches the whole sequence to them), the first positions included."""
    emb, ours = phi3_longrope()
    assert uses_long_factors(ours, max_model_len)
    positions = 600  # > 512: transformers computes this sequence with the long factors
    cache = build_cos_sin_cache(24, positions, 10000.0, ours, max_model_len=max_model_len)
    cos, sin = emb(torch.zeros(1, 1, 24), torch.arange(positions)[None])
    assert torch.equal(compute_inv_freq(24, 10000.0, ours, max_model_len), emb.inv_freq)
    torch.testing.assert_close(cache[:, :12], cos[0, :, :12], atol=0, rtol=0)
    torch.testing.assert_close(cache[:, 12:], sin[0, :, :12], atol=0, rtol=0)
    short = build_cos_sin_cache(24, positions, 10000.0, ours)
    assert not torch.equal(cache[1:], short[1:])  # position 0 is cos 1, sin 0 either way


def test_longrope_factor_lists_are_checked():
    _, ours = phi3_longrope()
    with pytest.raises(ValueError, match="longrope long_factor needs 12 values"):
        compute_inv_freq(24, 10000.0, {**ours, "long_factor": [1.0] * 11}, max_model_len=1024)
    no_long = {k: v for k, v in ours.items() if k != "long_factor"}
    with pytest.raises(ValueError, match="missing 'long_factor'"):
        compute_inv_freq(24, 10000.0, no_long, max_model_len=1024)
    # Within the original context the long factors are not read.
    assert compute_inv_freq(24, 10000.0, no_long, max_model_len=512).shape == (12,)
    assert not uses_long_factors(LLAMA3, 1 << 20)  # only longrope has two sets


def check_table(emb, rotary_dim, base, scaling, num_positions, max_model_len=None):
    assert torch.equal(compute_inv_freq(rotary_dim, base, scaling, max_model_len), emb.inv_freq)
    cache = build_cos_sin_cache(rotary_dim, num_positions, base, scaling,
                                max_model_len=max_model_len)  # fmt: skip
    cos, sin = emb(torch.zeros(1, 1, rotary_dim), torch.arange(num_positions)[None])
    half = rotary_dim // 2
    torch.testing.assert_close(cache[:, :half], cos[0, :, :half], atol=0, rtol=0)
    torch.testing.assert_close(cache[:, half:], sin[0, :, :half], atol=0, rtol=0)
