"""RMSNorm on CPU ranks, optionally fused with the residual add: one pass over
each row for the sum with the residual, the mean square and the scaling.

Rounded where the reference rounds (Hugging Face's order): the sum with the
residual in the tensors' dtype, the normalised row cast to it before the weight
multiplies, the product cast again; in fp32 each rounding is the identity. Two
kernels (:mod:`.dispatch`): the loops, for any rows, and vector tiles for
contiguous bf16 rows of a multiple of 16 values (:mod:`.tiles`: a 512-token
prefill step's RMSNorm 14.3 -> 9.9 ms, docs/kernels.md).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import checks, reference
from . import dispatch
from .fastmath import as_array, load_f32, round_to, store_f32
from .jit import compiled, jit
from .tiles import add_square_sum_tile, scale_tile, square_sum_tile


@jit()
def _rms_norm_rows(x, weight, eps, out):
    rows, width = x.shape
    for i in range(rows):
        total = np.float32(0.0)  # fp32, as the reference's mean: 1.5x faster than fp64
        for j in range(width):
            v = load_f32(x, (i, j))
            total += v * v
        inv = np.float32(1.0 / math.sqrt(total / width + eps))
        for j in range(width):
            normed = round_to(out, load_f32(x, (i, j)) * inv)
            store_f32(out, (i, j), load_f32(weight, j) * normed)


@jit()
def _add_rms_norm_rows(x, residual, weight, eps, out, summed):
    rows, width = x.shape
    for i in range(rows):
        total = np.float32(0.0)  # fp32, as the reference's mean: 1.5x faster than fp64
        for j in range(width):
            s = round_to(summed, load_f32(x, (i, j)) + load_f32(residual, (i, j)))
            store_f32(summed, (i, j), s)
            total += s * s
        inv = np.float32(1.0 / math.sqrt(total / width + eps))
        for j in range(width):
            normed = round_to(out, load_f32(summed, (i, j)) * inv)
            store_f32(out, (i, j), load_f32(weight, j) * normed)


@jit()
def _rms_norm_rows_bf16(x, weight, eps, out):
    """:func:`_rms_norm_rows` for bf16 rows of a multiple of 16 values, in vector
    tiles (:mod:`.cpu_tiles`); ``x`` and ``out`` as ``[rows, width]`` bits."""
    rows, width = x.shape
    chunks = width // 16
    x_flat, out_flat = x.reshape(-1), out.reshape(-1)
    for i in range(rows):
        total = square_sum_tile(x_flat, i * width, chunks)
        inv = np.float32(1.0 / math.sqrt(total / width + eps))
        scale_tile(x_flat, i * width, weight, inv, out_flat, i * width, chunks)


@jit()
def _add_rms_norm_rows_bf16(x, residual, weight, eps, out, summed):
    """:func:`_add_rms_norm_rows` in vector tiles, as :func:`_rms_norm_rows_bf16`."""
    rows, width = x.shape
    chunks = width // 16
    x_flat, r_flat = x.reshape(-1), residual.reshape(-1)
    out_flat, s_flat = out.reshape(-1), summed.reshape(-1)
    for i in range(rows):
        total = add_square_sum_tile(x_flat, i * width, r_flat, i * width, s_flat, i * width,
                                    chunks)  # fmt: skip
        inv = np.float32(1.0 / math.sqrt(total / width + eps))
        scale_tile(s_flat, i * width, weight, inv, out_flat, i * width, chunks)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference.rms_norm` in one pass over each row."""
    if not compiled(x, weight) or (residual is not None and not compiled(residual)):
        return reference.rms_norm(x, weight, eps, residual)
    checks.check_rms_norm(x, weight, eps, residual)
    rows16 = (
        x.shape[1] % 16 == 0 and x.is_contiguous() and x.dtype == weight.dtype
        and (residual is None or residual.is_contiguous())
    )  # fmt: skip
    name = dispatch.BF16 if x.dtype == torch.bfloat16 else dispatch.FP32
    tiles = dispatch.current().kernel("rms_norm", name, ROWS16 if rows16 else NONE) == "tiles"
    # Plain allocations: placing the outputs off their inputs' 4K alias cost more
    # than it saved in every decode step measured (docs/kernels.md, 4K aliasing).
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if residual is None:
        kernel = _rms_norm_rows_bf16 if tiles else _rms_norm_rows
        kernel(as_array(x), as_array(weight), float(eps), as_array(out))
        return out
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    (_add_rms_norm_rows_bf16 if tiles else _add_rms_norm_rows)(
        as_array(x), as_array(residual), as_array(weight), float(eps), as_array(out),
        as_array(summed),
    )  # fmt: skip
    return out, summed


ROWS16, NONE = frozenset({"rows16"}), frozenset()
