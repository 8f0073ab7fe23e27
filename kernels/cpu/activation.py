"""A gated MLP's activation on CPU ranks: ``act(x[:, :d]) * x[:, d:]``.

In the tensors' dtype, as Hugging Face's MLPs compute it (the activation rounded,
then the product). torch's vectorized exponential beats a compiled scalar loop
over the rows: in a 144M model's decode step of 32 rows, 3.3 ms a step against
6–23 ms, and 1.5 against 5 ms for the fp32 round trip of
:func:`reference.silu_mul`. For bf16 rows a vector tile beats torch's two passes
(:func:`.tiles.silu_mul_tile`, 1.6x at 32 to 512 rows of 2816 values): the
dispatch table's ``tiles`` kernel; GELU's tanh form (Gemma) likewise
(:func:`.tiles.gelu_tanh_mul_tile`).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import checks, reference
from . import dispatch
from .fastmath import as_array, exp_f32, load_f32, round_to, store_f32, tanh_f32
from .jit import available, jit
from .tiles import GELU_BETA, GELU_KAPPA, gelu_tanh_mul_tile, silu_mul_tile


@jit()
def _act(g, gelu):
    """SiLU of the fp32 ``g`` (``gelu`` None), or GELU's tanh form as the tile and
    torch compute it."""
    if gelu is None:
        return g / (np.float32(1.0) + exp_f32(-g))
    z = (g + np.float32(GELU_KAPPA) * g * g * g) * np.float32(GELU_BETA)
    return g * np.float32(0.5) * (np.float32(1.0) + tanh_f32(z))


@jit()
def _gated_mul_rows_bf16(x, out, gelu):
    """``out[i] = round(act(x[i, :d])) * x[i, d:]`` (rounded) for bf16 rows as their
    bits, ``d`` = ``out``'s width, ``act`` SiLU (``gelu`` None) or GELU: whole
    tiles of 16 values by :func:`.tiles.silu_mul_tile` or
    :func:`.tiles.gelu_tanh_mul_tile`, the rest of a row one value at a time (the
    same exponential, so the same values)."""
    rows, width = out.shape
    chunks = width // 16
    x_flat, out_flat = x.reshape(-1), out.reshape(-1)
    for i in range(rows):
        if gelu is None:
            silu_mul_tile(x_flat, 2 * i * width, (2 * i + 1) * width, out_flat, i * width, chunks)
        else:
            gelu_tanh_mul_tile(x_flat, 2 * i * width, (2 * i + 1) * width, out_flat, i * width,
                               chunks)  # fmt: skip
        for j in range(16 * chunks, width):
            g = load_f32(x, (i, j))
            act = round_to(out, _act(g, gelu))
            store_f32(out, (i, j), act * load_f32(x, (i, width + j)))


def _gated_mul(x: torch.Tensor, op: str, gelu) -> torch.Tensor | None:
    """The tiles' ``op`` of contiguous bf16 rows, where the dispatch table says so;
    None where it does not (the reference's)."""
    if not (
        available() and isinstance(x, torch.Tensor) and x.is_cpu and x.dtype == torch.bfloat16
        and x.dim() == 2 and x.is_contiguous()
        and dispatch.current().kernel(op, dispatch.BF16, ROWS16) == "tiles"
    ):  # fmt: skip
        return None
    checks.check_silu_mul(x)
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    if x.shape[0]:
        _gated_mul_rows_bf16(as_array(x), as_array(out), gelu)
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`reference.silu_mul_in_dtype` (the SiLU of ``x[:, :d]`` rounded to the
    dtype, times ``x[:, d:]``, rounded); for contiguous bf16 rows in one pass over
    each row where the dispatch table says so. Equal to torch's in tests over
    millions of values; its exponential saturates where torch's overflows, so a
    row holding ``-inf`` gets ``-inf·u`` where torch gets NaN."""
    out = _gated_mul(x, "silu_mul", None)
    return reference.silu_mul_in_dtype(x) if out is None else out


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`reference.gelu_tanh_mul_in_dtype` (Gemma's GELU, tanh form, of
    ``x[:, :d]`` rounded to the dtype, times ``x[:, d:]``, rounded); for
    contiguous bf16 rows in one pass as :func:`silu_mul`, by torch's formula with
    Cephes' tanh (torch's is another approximation of it): a bf16 result may
    differ from torch's by one step, rarely."""
    out = _gated_mul(x, "gelu_tanh_mul", True)
    return reference.gelu_tanh_mul_in_dtype(x) if out is None else out


ROWS16 = frozenset({"rows16"})
