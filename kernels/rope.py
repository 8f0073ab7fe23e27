"""Rotary embedding tables, computed the way Hugging Face transformers does.

``inv_freq`` is computed in fp32 from ``arange(0, head_dim, 2)`` exactly like
``transformers.modeling_rope_utils`` (rope types ``default``, ``linear``,
``llama3``, ``yarn`` and ``longrope``), then ``cos``/``sin`` of
``position * inv_freq`` are taken in fp32 and multiplied by the type's
attention factor (yarn's and longrope's; 1 otherwise). The resulting cache is
``[max_position, head_dim]``: the first ``head_dim / 2`` columns hold cos, the
last ``head_dim / 2`` hold sin. ``head_dim`` here is the rotated width, which a
partial rotary embedding (Phi-3.5 / Phi-4-mini) makes smaller than the head.

``longrope`` (Phi-3 / Phi-3.5 / Phi-4-mini) has two sets of factors. transformers
picks one per forward call, from the longest position in it: ``long_factor``
once the sequence is longer than ``original_max_position_embeddings``,
``short_factor`` otherwise, keeping the keys it cached under the short ones. A
cache that outlives one sequence (paged, prefix-shared) cannot follow that
switch, so a table takes one set for every position, fixed by the context the
engine serves (``max_model_len``), as vLLM does
(``Phi3LongRoPEScaledRotaryEmbedding``'s ``use_long_rope``): ``long_factor``
when ``max_model_len > original_max_position_embeddings``, ``short_factor``
otherwise (:func:`uses_long_factors`). Served within the original context a
model gets transformers' numbers exactly; served past it, every sequence gets
the long factors: transformers' numbers for a prompt already longer than the
original, not for a shorter one. Both sets share the attention factor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def _rope_type(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    # Older configs spell the key "type"; both are accepted by transformers.
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def uses_long_factors(scaling: Mapping[str, Any] | None, max_model_len: int | None) -> bool:
    """Whether a table for a context of ``max_model_len`` positions takes a ``longrope``
    scaling's ``long_factor``: when ``max_model_len`` exceeds
    ``original_max_position_embeddings`` (vLLM's rule); ``short_factor`` when it does
    not or is None. False for every other rope type."""
    if _rope_type(scaling) != "longrope" or max_model_len is None:
        return False
    assert scaling is not None
    return max_model_len > _need(scaling, "original_max_position_embeddings", "longrope")


def compute_inv_freq(
    head_dim: int,
    base: float,
    scaling: Mapping[str, Any] | None = None,
    max_model_len: int | None = None,
) -> torch.Tensor:
    """The fp32 inverse frequencies ``[head_dim / 2]`` of a Llama-style rotary embedding.
    ``max_model_len``: the context served, which picks a ``longrope`` scaling's factors
    (:func:`uses_long_factors`; None: the short ones); unused by the other types."""
    if head_dim <= 0 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (base**exponent)
    rope_type = _rope_type(scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, scaling)
    if rope_type == "longrope":
        key = "long_factor" if uses_long_factors(scaling, max_model_len) else "short_factor"
        factors = torch.tensor(_need(scaling, key, rope_type), dtype=torch.float32)
        if factors.shape != (head_dim // 2,):
            raise ValueError(f"longrope {key} needs {head_dim // 2} values")
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (factors * base**shape)
    raise ValueError(f"scaling has unsupported rope_type {rope_type!r}")


def _need(scaling: Mapping[str, Any], key: str, rope_type: str) -> Any:
    try:
        return scaling[key]
    except KeyError:
        raise ValueError(f"scaling for rope_type {rope_type!r} is missing {key!r}") from None


def attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """What yarn and longrope multiply cos and sin by (1 for the other types)."""
    rope_type = _rope_type(scaling)
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    assert scaling is not None
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = float(_need(scaling, "factor", rope_type))
    if rope_type == "longrope":
        original = _need(scaling, "original_max_position_embeddings", rope_type)
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    """YaRN: extrapolated frequencies above a band, interpolated (``/ factor``)
    below it, a linear ramp across it; the band from ``beta_fast`` / ``beta_slow``
    rotations over the original context."""
    factor = float(_need(scaling, "factor", "yarn"))
    original = _need(scaling, "original_max_position_embeddings", "yarn")
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # how much of each frequency is extrapolated
    return interpolated * (1 - keep) + extrapolated * keep


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    try:
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
    except KeyError as e:
        raise ValueError(f"scaling for rope_type 'llama3' is missing {e.args[0]!r}") from None

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed down by `factor`, short ones
    # are kept, and the band in between is interpolated smoothly.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    scaling: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    max_model_len: int | None = None,
) -> torch.Tensor:
    """``[max_position, head_dim]`` table: cos in the first half, sin in the second.
    ``max_model_len``: the context the engine serves, which picks a ``longrope``
    scaling's factors for every row (long past ``original_max_position_embeddings``,
    see the module docstring; None: the short ones)."""
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    inv_freq = compute_inv_freq(head_dim, base, scaling, max_model_len)  # [head_dim / 2], fp32
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
    scale = attention_factor(scaling)
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return (table * scale if scale != 1.0 else table).to(dtype)
