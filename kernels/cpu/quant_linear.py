"""Quantized matrix products on a CPU rank: the weight packed once at load for the
kernel the dispatch table picks, then every call on that kernel.

Two ops of the table (:mod:`.dispatch`), one per kind of quantized weight
(:mod:`iterserve.kernels.quant`):

- ``linear.w8a8``: int8 weights, the rows quantized to int8 per call.
  ``amx_int8`` (:mod:`.amx_quant`, AMX-INT8 tiles) where the CPU has AMX;
  ``onednn_int8`` elsewhere: oneDNN's int8 matmul (``qlinear_pointwise``, VNNI's
  ``vpdpbusd`` where the CPU has it) on the rows shifted to uint8 (zero point 128,
  scale 1), its fp32 output scaled by each row's scale afterwards, so the rows keep
  scales of their own; ``reference`` where neither runs (no oneDNN in the build).
- ``linear.wx``: 4- or 8-bit weights (integers or fp8) widened to bf16 inside the
  product. ``amx_widen`` (:mod:`.amx_quant`) for bf16 rows on AMX CPUs; elsewhere
  ``reference``, which widens the whole weight for each call
  (:func:`iterserve.kernels.quant.dequantize`) and multiplies in the rows' dtype.

The kernels read different layouts of the weight, so the table is read once a
weight, when it is packed, with the engine's dtype and level; each call then runs
that weight's kernel. Products of more than one torch thread split the weight's
panels across numba's threads (the AMX kernels) or leave it to oneDNN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import quant
from ..quant import W8A8, QuantizedTensors, QuantizedWeight
from . import dispatch
from .fastmath import as_array
from .jit import available, use_threads

OPS = {W8A8: "linear.w8a8", quant.WX: "linear.wx"}
_ONEDNN_ZERO = 128  # oneDNN's int8 matmul takes uint8 rows: int8 + 128


@dataclass(frozen=True)
class _Int8:
    """What the int8 kernels read: the packed weight, each output's scale and sum of
    its int8 values (for rows with a zero point), and how rows are quantized."""

    weight: object  # amx_quant.pack_int8's array, or oneDNN's packed tensor
    scales: np.ndarray  # fp32 [out padded to 32]
    sums: np.ndarray  # int32 [out padded]
    activations: quant.Activations
    in_padded: int


@dataclass(frozen=True)
class _Widen:
    values: np.ndarray  # amx_quant.pack_dequant's
    scales: np.ndarray  # fp32 [panel, group, 32]
    zeros: np.ndarray
    chunk_groups: np.ndarray  # int32 [chunks]
    bits: int
    number: str
    perm: torch.Tensor | None


def _dtype_name(dtype: torch.dtype) -> str:
    return dispatch.BF16 if dtype == torch.bfloat16 else dispatch.FP32


def choose(q: QuantizedTensors, dtype: torch.dtype, level: str | None = None) -> str:
    """The kernel of ``q``'s op for rows of ``dtype`` (at ``level``; default this
    process's). fp16 rows (which the compiled kernels do not take) get the reference,
    as does a process without numba."""
    if dtype not in (torch.float32, torch.bfloat16) or not available():
        return "reference"
    table = dispatch.current() if level is None else dispatch.Dispatch(level)
    kernel = table.kernel(OPS[q.kind], _dtype_name(dtype), frozenset())
    if kernel == "onednn_int8" and not torch.backends.mkldnn.is_available():
        return "reference"
    return kernel


def pack(q: QuantizedTensors, dtype: torch.dtype) -> QuantizedWeight:
    """``q`` laid out for the kernel the table picks for rows of ``dtype``."""
    kernel = choose(q, dtype)
    describe = f"{q.describe()} ({kernel})"
    if kernel == "amx_int8" or kernel == "onednn_int8":
        data = _pack_int8(q, kernel)
    elif kernel == "amx_widen":
        data = _pack_widen(q)
    else:
        data = q
    return QuantizedWeight(kernel, q.shape, data, describe)


def _padded(values: torch.Tensor, n: int, fill: float = 0.0) -> np.ndarray:
    out = torch.full((n,), fill, dtype=values.dtype)
    out[: values.shape[0]] = values
    return out.numpy()


def _pack_int8(q: QuantizedTensors, kernel: str) -> _Int8:
    from . import amx_quant

    out_features, in_features = q.shape
    n = -(-out_features // amx_quant.PANEL) * amx_quant.PANEL
    sums = q.values.to(torch.int32).sum(dim=1, dtype=torch.int32)
    if kernel == "amx_int8":
        weight = amx_quant.pack_int8(q.values)
        in_padded = -(-in_features // amx_quant.INT8_CHUNK) * amx_quant.INT8_CHUNK
    else:
        weight = torch.ops.onednn.qlinear_prepack(q.values.contiguous(), [1, in_features])
        in_padded = in_features
    return _Int8(weight, _padded(q.scales.float(), n, 1.0), _padded(sums, n), q.activations,
                 in_padded)  # fmt: skip


def _pack_widen(q: QuantizedTensors) -> _Widen:
    from . import amx_quant

    zeros = q.zeros if q.zeros is not None else torch.zeros_like(q.scales)
    return _Widen(
        amx_quant.pack_dequant(q.values, q.bits), amx_quant.panel_groups(q.scales.float()),
        amx_quant.panel_groups(zeros.float()), q.chunk_groups.to(torch.int32).numpy(), q.bits,
        q.number, q.perm,
    )  # fmt: skip


def product(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` (``x``: ``[rows, in]``) on ``weight``'s kernel."""
    kernel = weight.kernel
    if kernel == "reference":
        return quant.linear(x, weight.data, bias)
    if kernel == "amx_int8":
        return _amx_int8(x, weight, bias)
    if kernel == "onednn_int8":
        return _onednn_int8(x, weight, bias)
    return _amx_widen(x, weight, bias)


def _bias(bias: torch.Tensor | None, n: int) -> np.ndarray:
    padded = torch.zeros(-(-n // 32) * 32, dtype=torch.float32)
    if bias is not None:
        padded[:n] = bias
    return padded.numpy()


def _run(one, parallel, args, outputs: int) -> None:
    """``one(*args)`` on this thread, or ``parallel(*args, threads)`` with the weight's
    panels split across torch's threads (each takes whole panels: the same sums)."""
    from .amx_quant import PANEL

    threads = min(torch.get_num_threads(), -(-outputs // PANEL))
    if threads > 1:
        use_threads(threads)
        parallel(*args, threads)
    else:
        one(*args)


def _quantized_rows(x: torch.Tensor, d: _Int8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from . import amx_quant

    a = d.activations
    rows = x.shape[0]
    xq = np.empty((rows, d.in_padded), dtype=np.int8)
    scales = np.empty(rows, dtype=np.float32)
    zeros = np.empty(rows, dtype=np.int32)
    static = np.float32(0.0 if a.dynamic else a.scale)
    amx_quant.quantize_rows(as_array(x), xq, scales, zeros, static, a.zero, not a.symmetric,
                            not a.per_token)  # fmt: skip
    return xq, scales, zeros


def _amx_int8(x: torch.Tensor, weight: QuantizedWeight, bias) -> torch.Tensor:
    from . import amx_quant

    d: _Int8 = weight.data
    x = x.contiguous()
    xq, scales, zeros = _quantized_rows(x, d)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    args = (xq, scales, zeros, d.weight, d.scales, d.sums, _bias(bias, weight.shape[0]),
            as_array(out))  # fmt: skip
    _run(amx_quant.int8_product, amx_quant.int8_product_parallel, args, weight.shape[0])
    return out


def _onednn_int8(x: torch.Tensor, weight: QuantizedWeight, bias) -> torch.Tensor:
    d: _Int8 = weight.data
    n = weight.shape[0]
    xq, scales, zeros = _quantized_rows(x.contiguous(), d)
    shifted = (torch.from_numpy(xq).to(torch.int16) + _ONEDNN_ZERO).to(torch.uint8)
    w_scales = torch.from_numpy(d.scales[:n])
    y = torch.ops.onednn.qlinear_pointwise(
        shifted, 1.0, _ONEDNN_ZERO, d.weight, w_scales, torch.zeros(n, dtype=torch.int64), None,
        1.0, 0, torch.float32, "none", [], "",
    )  # fmt: skip  # [rows, out]: sum(xq * wq) * w_scale
    row_zero = torch.from_numpy(zeros)[:, None]
    if d.activations.symmetric and d.activations.zero == 0:
        y = y * torch.from_numpy(scales)[:, None]
    else:
        correction = torch.from_numpy(d.sums[:n]).float() * w_scales
        y = (y - row_zero * correction) * torch.from_numpy(scales)[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _amx_widen(x: torch.Tensor, weight: QuantizedWeight, bias) -> torch.Tensor:
    from . import amx_quant

    d: _Widen = weight.data
    if d.perm is not None:
        x = torch.nn.functional.pad(x, (0, 1)).index_select(1, d.perm)
    x = x.contiguous()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    flags = (True if d.bits == 4 else None, True if d.number == "e4m3" else None,
             True if d.number == "e5m2" else None)  # fmt: skip
    args = (as_array(x), d.values, d.scales, d.zeros, d.chunk_groups, *flags,
            _bias(bias, weight.shape[0]), as_array(out))  # fmt: skip
    _run(amx_quant.dequant_product, amx_quant.dequant_product_parallel, args, weight.shape[0])
    return out
