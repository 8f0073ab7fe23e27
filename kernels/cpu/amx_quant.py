"""Quantized matrix products in AMX tiles: int8 by int8 (W8A8), and 4- or 8-bit
weights widened to bf16 inside the product (W4A16, W8A16, FP8 weight-only).

A decode step reads every weight once for a few dozen rows, so its products are
bound by how fast one core streams the weights from memory: a weight of one byte
(or half a byte) an element is read in a half (a quarter) of a bf16 weight's time.
Both kernels read weights packed at load in panels of 32 outputs (:func:`pack_int8`,
:func:`pack_dequant`), one panel after the other, and keep each panel's partial
sums for up to 32 rows in four 16x16 fp32 (int32) tiles: a 2x2 block of two tiles
of rows by two tiles of the weight: :func:`.amx_linear.block_pass`, the one loop
of every AMX product (bf16 dense, int8, and widened weights).

**int8** (``tdpbssd``): the rows are quantized to int8 per token first
(:func:`quantize_rows`: ``scale = max|x| / 127.5``, ``q = rint(x / scale)`` in
[-128, 127], as compressed-tensors computes a dynamic symmetric per-token scale; a
static scale, a per-tensor scale and zero points too), each tile product sums 64
products of int8 pairs a lane exactly in int32, and a panel's sums become outputs
as ``(sum - zp_row * colsum) * scale_row * scale_col + bias``, rounded once.
A chunk of a panel is 64 inputs: 16 rows of 128 bytes, each row four consecutive
inputs of each of the 32 outputs (AMX's layout of an int8 right-hand tile, two
tiles side by side).

**dequant** (``tdpbf16ps``): a panel's 4-bit (two a byte) or 8-bit values are
widened to bf16 first, into a scratch panel laid out as oneDNN lays a bf16 weight
out for AMX (:mod:`.amx_linear`): value ``v`` of output ``n`` in the group
``g`` of its chunk of 32 inputs becomes ``bf16((v - zero[g, n]) * scale[g, n])``,
the weight a dequantized checkpoint holds (``v`` an unsigned integer, or an fp8
number widened exactly: :mod:`.quant_tiles`), then the rows multiply it in
bf16 tiles with fp32 sums. The scratch panel (``in x 32`` bf16: 64 KiB for 1024
inputs) stays in L2 for every 32 rows of the batch; the weight itself is read from
memory once, and never becomes a dense copy.

Inputs that are not a multiple of the chunk, and outputs not a multiple of 32, are
padded with zero weights at packing; the kernels read inputs padded likewise
(:func:`padded_rows`).
"""

from __future__ import annotations

import numpy as np
import torch

from . import amx as cpu_amx
from .amx_linear import BF16_CHUNK, PANEL, block_pass, configure_passes
from .fastmath import load_f32, store_f32
from .jit import jit, prange

INT8_CHUNK = 64  # inputs an int8 tile row reads
INT8_MAX = 127.5  # compressed-tensors' symmetric int8 scale: max|x| / (255 / 2)

if cpu_amx.numba is not None:
    from .quant_tiles import (
        absmax_tile,
        f32_outputs_tile,
        int8_outputs_tile,
        quantize_tile,
        widen4_tile,
        widen8,
    )

_jit = jit()
# The rows' quantization divides as the reference does (x / scale rounded to the
# nearest integer): a fast reciprocal moves values next to a half across it.
_exact = (
    cpu_amx.numba.njit(fastmath={"nnan", "ninf", "nsz", "reassoc"}, nogil=True, cache=True,
                       error_model="numpy")
    if cpu_amx.numba is not None else (lambda fn: fn)
)  # fmt: skip


@_exact
def quantize_rows(x, xq, xs, xz, static_scale, static_zero, asymmetric, per_tensor):
    """``x`` (``[rows, in]``, fp32 or bf16 bits) quantized to int8 into ``xq``
    (``[rows, in_padded]``, zeros past ``in``), each row's scale into ``xs`` and zero
    point into ``xz``. ``static_scale`` > 0: that scale and ``static_zero`` for every
    row; else dynamic, per row or (``per_tensor``) over all of ``x``: symmetric
    ``max|x| / 127.5``, or (``asymmetric``) ``(max - min) / 255`` with the zero point
    that maps ``min`` to -128, as compressed-tensors computes them (0 always
    representable). A row of zeros gets scale 1. ``q = rint(x / scale) + zero``,
    saturated."""
    rows, width = x.shape
    chunks = width // 16
    lows = np.zeros(rows, dtype=np.float32)
    highs = np.zeros(rows, dtype=np.float32)
    if static_scale <= 0:
        for r in range(rows):
            if asymmetric:
                lo = np.float32(0.0)
                hi = np.float32(0.0)
                for k in range(width):
                    v = load_f32(x, (r, k))
                    lo = min(lo, v)
                    hi = max(hi, v)
            else:
                hi = absmax_tile(x, r * width, chunks)
                for k in range(chunks * 16, width):
                    hi = max(hi, abs(load_f32(x, (r, k))))
                lo = -hi
            lows[r], highs[r] = lo, hi
        if per_tensor:
            lo, hi = lows.min(), highs.max()
            lows[:], highs[:] = lo, hi
    for r in range(rows):
        if static_scale > 0:
            scale, zero = np.float32(static_scale), np.int32(static_zero)
        elif asymmetric:
            scale = (highs[r] - lows[r]) / np.float32(255.0)
            if scale == 0:
                scale = np.float32(1.0)
            zero = np.int32(min(max(np.rint(np.float32(-128.0) - lows[r] / scale), -128), 127))
        else:
            scale = max(-lows[r], highs[r]) / np.float32(INT8_MAX)
            if scale == 0:
                scale = np.float32(1.0)
            zero = np.int32(0)
        xs[r], xz[r] = scale, zero
        quantize_tile(x, r * width, chunks, scale, zero, xq, r * xq.shape[1])
        for k in range(chunks * 16, width):
            v = np.rint(load_f32(x, (r, k)) / scale) + zero
            xq[r, k] = np.int8(min(max(v, np.float32(-128.0)), np.float32(127.0)))
        for k in range(width, xq.shape[1]):
            xq[r, k] = 0


@_jit
def _int8_outputs(sums, rows, first, col0, xs, xz, ws, wsum, bias, out):
    """A panel's int32 sums for ``rows`` rows from row ``first`` as outputs ``col0..``
    (those of the 32 that exist): :func:`.quant_tiles.int8_outputs_tile`."""
    columns = min(PANEL, out.shape[1] - col0)
    whole = columns // 16
    stride = out.shape[1]
    flat = out.reshape(-1)
    for r in range(rows):
        row = first + r
        zero, scale = xz[row], xs[row]
        int8_outputs_tile(sums, r * 32, zero, scale, ws, wsum, bias, col0, flat,
                          row * stride + col0, whole)  # fmt: skip
        for n in range(whole * 16, columns):
            v = np.float32(sums[r * 32 + n] - zero * wsum[col0 + n]) * (scale * ws[col0 + n])
            store_f32(flat, row * stride + col0 + n, v + bias[col0 + n])


@_jit
def _int8_panels(xq, xs, xz, weight, ws, wsum, bias, out, first_panel, last_panel):
    """Panels ``first_panel..last_panel - 1`` of the int8 product into ``out``."""
    sums = np.empty(32 * 32, dtype=np.int32)
    config = np.empty(64, dtype=np.uint8)
    rows, width = xq.shape
    xq_flat = xq.reshape(-1)
    once = configure_passes(config, rows)
    panel_size = width * PANEL
    for panel in range(first_panel, last_panel):
        for first in range(0, rows, 32):
            count = min(32, rows - first)
            # a chunk: 16 rows of 128 bytes; the panel's weight is read from memory in
            # its first pass, from L2 in the others
            block_pass(config, once, xq_flat, first, count, width, INT8_CHUNK, weight,
                       panel * panel_size, 2048, 64, sums, True)  # fmt: skip
            _int8_outputs(sums, count, first, panel * PANEL, xs, xz, ws, wsum, bias, out)
    cpu_amx.release_tiles()


@_jit
def int8_product(xq, xs, xz, weight, ws, wsum, bias, out):
    """``out[r, n] = (sum_k xq[r, k] w[n, k] - xz[r] wsum[n]) xs[r] ws[n] (+ bias[n])``
    for int8 ``xq`` ``[rows, in_padded]``, ``weight`` :func:`pack_int8`'s, on one thread."""
    panels = (out.shape[1] + PANEL - 1) // PANEL
    _int8_panels(xq, xs, xz, weight, ws, wsum, bias, out, 0, panels)


@jit(parallel=True)
def int8_product_parallel(xq, xs, xz, weight, ws, wsum, bias, out, parts):
    """:func:`int8_product` with the panels split in ``parts`` across numba's
    threads, each with tiles and scratch of its own."""
    panels = (out.shape[1] + PANEL - 1) // PANEL
    for part in prange(parts):
        lo, hi = part * panels // parts, (part + 1) * panels // parts
        _int8_panels(xq, xs, xz, weight, ws, wsum, bias, out, lo, hi)


if cpu_amx.numba is not None:
    _widen_int8, _widen_e4m3, _widen_e5m2 = widen8("int"), widen8("e4m3"), widen8("e5m2")


@_jit
def _widen_panel(values, panel, scales, zeros, chunk_groups, four, e4m3, e5m2, scratch,
                 lane_scale, lane_zero):  # fmt: skip
    """Panel ``panel``'s values as bf16 bits into ``scratch`` (``[chunks * 1024]``):
    element ``j`` of a chunk (``j = 64 r + 2 n + i``: input ``32 c + 2 r + i`` of
    output ``n``) is ``bf16((v - zeros[panel, g, n]) * scales[panel, g, n])`` for
    the chunk's group ``g``, ``v`` the value as an unsigned integer or (``e4m3``,
    ``e5m2`` not None) an fp8 number. 4-bit values (``four`` not None) hold element
    ``j`` of a chunk in the low half of byte ``j`` for ``j < 512``, in the high
    half of byte ``j - 512`` above; 8-bit ones one a byte."""
    chunks = chunk_groups.shape[0]
    chunk_bytes = 512 if four is not None else 1024
    group = -1
    for c in range(chunks):
        at = (panel * chunks + c) * chunk_bytes
        if chunk_groups[c] != group:
            group = chunk_groups[c]
            for lane in range(64):
                lane_scale[lane] = scales[panel, group, lane >> 1]
                lane_zero[lane] = zeros[panel, group, lane >> 1]
        if four is not None:
            widen4_tile(values, at, lane_scale, lane_zero, scratch, c * 1024, 8)
        elif e4m3 is not None:
            _widen_e4m3(values, at, lane_scale, lane_zero, scratch, c * 1024)
        elif e5m2 is not None:
            _widen_e5m2(values, at, lane_scale, lane_zero, scratch, c * 1024)
        else:
            _widen_int8(values, at, lane_scale, lane_zero, scratch, c * 1024)


@_jit
def _dequant_panels(x, values, scales, zeros, chunk_groups, four, e4m3, e5m2, bias, out,
                    first_panel, last_panel):  # fmt: skip
    rows, width = x.shape
    outputs = out.shape[1]
    flat_out = out.reshape(-1)
    x_flat = x.reshape(-1)
    sums = np.empty(32 * 32, dtype=np.float32)
    config = np.empty(64, dtype=np.uint8)
    scratch = np.empty(chunk_groups.shape[0] * 1024, dtype=np.uint16)
    lane_scale = np.empty(64, dtype=np.float32)
    lane_zero = np.empty(64, dtype=np.float32)
    for panel in range(first_panel, last_panel):
        _widen_panel(values, panel, scales, zeros, chunk_groups, four, e4m3, e5m2, scratch,
                     lane_scale, lane_zero)  # fmt: skip
        once = configure_passes(config, rows)
        for first in range(0, rows, 32):
            count = min(32, rows - first)
            # a chunk of the widened panel: 16 pairs of inputs by 32 outputs
            block_pass(config, once, x_flat, first, count, width, BF16_CHUNK, scratch, 0, 1024,
                       32, sums, None)  # fmt: skip
            col0 = panel * PANEL
            columns = min(PANEL, outputs - col0)
            whole = columns // 16
            for r in range(count):
                at = (first + r) * outputs + col0
                f32_outputs_tile(sums, r * 32, bias, col0, flat_out, at, whole)
                for n in range(whole * 16, columns):
                    store_f32(flat_out, at + n, sums[r * 32 + n] + bias[col0 + n])
        cpu_amx.release_tiles()


@_jit
def dequant_product(x, values, scales, zeros, chunk_groups, four, e4m3, e5m2, bias, out):
    """``out = x @ W.T + bias`` for bf16 ``x`` (bits, ``[rows, in_padded]``) and ``W``
    widened from :func:`pack_dequant`'s ``values`` (see :func:`_widen_panel`), on one
    thread."""
    panels = (out.shape[1] + PANEL - 1) // PANEL
    _dequant_panels(x, values, scales, zeros, chunk_groups, four, e4m3, e5m2, bias, out, 0,
                    panels)  # fmt: skip


@jit(parallel=True)
def dequant_product_parallel(x, values, scales, zeros, chunk_groups, four, e4m3, e5m2, bias, out,
                             parts):  # fmt: skip
    """:func:`dequant_product` with the panels split in ``parts`` across numba's threads."""
    panels = (out.shape[1] + PANEL - 1) // PANEL
    for part in prange(parts):
        lo, hi = part * panels // parts, (part + 1) * panels // parts
        _dequant_panels(x, values, scales, zeros, chunk_groups, four, e4m3, e5m2, bias, out, lo,
                        hi)  # fmt: skip


def pack_int8(q: torch.Tensor) -> np.ndarray:
    """int8 ``q`` (``[out, in]``) as :func:`int8_product` reads it: outputs padded to
    32, inputs to 64 with zeros; ``[panel, chunk, quad, output, 4]`` flat."""
    out_features, in_features = q.shape
    n, k = _ceil(out_features, PANEL), _ceil(in_features, INT8_CHUNK)
    padded = torch.zeros(n, k, dtype=torch.int8)
    padded[:out_features, :in_features] = q
    blocks = padded.view(n // PANEL, PANEL, k // INT8_CHUNK, 16, 4).permute(0, 2, 3, 1, 4)
    return blocks.contiguous().view(-1).numpy()


def pack_dequant(values: torch.Tensor, bits: int) -> np.ndarray:
    """uint8 ``values`` (``[out, in]``, inputs a multiple of 32) as
    :func:`dequant_product` reads them: outputs padded to 32; each chunk of 32
    inputs of a panel as its 1024 bf16 elements' order (``[pair, output, 2]``), 4-bit
    values two a byte (element ``j`` low, ``j + 512`` high)."""
    out_features, in_features = values.shape
    n = _ceil(out_features, PANEL)
    padded = torch.zeros(n, in_features, dtype=torch.uint8)
    padded[:out_features] = values
    chunks = padded.view(n // PANEL, PANEL, in_features // BF16_CHUNK, 16, 2)
    chunks = chunks.permute(0, 2, 3, 1, 4).reshape(-1, 1024)  # [panel * chunk, 1024]
    if bits == 8:
        return chunks.contiguous().view(-1).numpy()
    return (chunks[:, :512] | (chunks[:, 512:] << 4)).contiguous().view(-1).numpy()


def panel_groups(table: torch.Tensor) -> np.ndarray:
    """``[out, groups]`` fp32 scales or zeros as ``[panel, group, 32]`` (outputs
    padded to 32 with ones)."""
    out_features, groups = table.shape
    n = _ceil(out_features, PANEL)
    padded = torch.ones(n, groups, dtype=torch.float32)
    padded[:out_features] = table
    return padded.view(n // PANEL, PANEL, groups).permute(0, 2, 1).contiguous().numpy()


def _ceil(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
