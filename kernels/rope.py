"""Rotary embedding tables, computed the way Hugging Face transformers does for Llama.

``inv_freq`` is computed in fp32 from ``arange(0, head_dim, 2)`` exactly like
``transformers.modeling_rope_utils`` (default and ``llama3`` rope types), then
``cos``/``sin`` of ``position * inv_freq`` are taken in fp32. The resulting
cache is ``[max_position, head_dim]``: the first ``head_dim / 2`` columns hold
cos, the last ``head_dim / 2`` hold sin.
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


def compute_inv_freq(
    head_dim: int, base: float, scaling: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """The fp32 inverse frequencies ``[head_dim / 2]`` of a Llama-style rotary embedding."""
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
    raise ValueError(f"scaling has unsupported rope_type {rope_type!r}")


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
) -> torch.Tensor:
    """``[max_position, head_dim]`` table: cos in the first half, sin in the second."""
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    inv_freq = compute_inv_freq(head_dim, base, scaling)  # [head_dim / 2], fp32
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
