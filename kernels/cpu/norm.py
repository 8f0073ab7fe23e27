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
def _summed(x, residual, summed, i, j):
    """Row ``i``'s value ``j`` of ``x``, plus the residual's (rounded, and kept in
    ``summed``) when there is one: ``residual`` None compiles the plain norm."""
    if residual is None:
        return load_f32(x, (i, j))
    s = round_to(summed, load_f32(x, (i, j)) + load_f32(residual, (i, j)))
    store_f32(summed, (i, j), s)
    return s


@jit()
def _rms_norm_rows(x, residual, weight, eps, out, summed):
    """Each row normalised into ``out``; with a ``residual`` (not None) the row is
    ``x + residual``, kept in ``summed`` as the next layer's residual."""
    rows, width = x.shape
    normed_from = x if residual is None else summed
    for i in range(rows):
        total = np.float32(0.0)  # fp32, as the reference's mean: 1.5x faster than fp64
        for j in range(width):
            s = _summed(x, residual, summed, i, j)
            total += s * s
        inv = np.float32(1.0 / math.sqrt(total / width + eps))
        for j in range(width):
            normed = round_to(out, load_f32(normed_from, (i, j)) * inv)
            store_f32(out, (i, j), load_f32(weight, j) * normed)


@jit()
def _rms_norm_rows_bf16(x, residual, weight, eps, out, summed):
    """:func:`_rms_norm_rows` for bf16 rows of a multiple of 16 values, in vector
    tiles (:mod:`.tiles`); the arrays as ``[rows, width]`` bits."""
    rows, width = x.shape
    chunks = width // 16
    x_flat, out_flat = x.reshape(-1), out.reshape(-1)
    for i in range(rows):
        at = i * width
        if residual is None:
            total = square_sum_tile(x_flat, at, chunks)
            inv = np.float32(1.0 / math.sqrt(total / width + eps))
            scale_tile(x_flat, at, weight, inv, out_flat, at, chunks)
        else:
            s_flat = summed.reshape(-1)
            total = add_square_sum_tile(x_flat, at, residual.reshape(-1), at, s_flat, at, chunks)
            inv = np.float32(1.0 / math.sqrt(total / width + eps))
            scale_tile(s_flat, at, weight, inv, out_flat, at, chunks)


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
    kernel = _rms_norm_rows_bf16 if tiles else _rms_norm_rows
    if residual is None:
        kernel(as_array(x), None, as_array(weight), float(eps), as_array(out), None)
        return out
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    kernel(as_array(x), as_array(residual), as_array(weight), float(eps), as_array(out),
           as_array(summed))  # fmt: skip
    return out, summed


ROWS16, NONE = frozenset({"rows16"}), frozenset()
