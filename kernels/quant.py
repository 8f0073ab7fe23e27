"""Quantized weights: the form every backend packs them from, and the torch
references of their products.

A checkpoint's quantized projection reaches the kernels as one
:class:`QuantizedTensors` (made by the loader, :mod:`iterserve.workers.quant`),
whatever format it was stored in:

- ``w8a8``: int8 weights with one fp32 scale an output (a per-tensor scale is
  repeated), and how the product's inputs are quantized (:class:`Activations`):
  the product is ``(xq @ wq.T - xz * colsum) * x_scale * w_scale``, exact in
  int32 (compressed-tensors' ``int-quantized``);
- ``wx``: weight-only, activations stay 16-bit. Each value is an unsigned
  4- or 8-bit integer (``number`` "int") or an fp8 number ("e4m3", "e5m2") and
  widens to ``(v - zero[n, g]) * scale[n, g]`` for the group ``g`` of its input,
  rounded to the activations' dtype: what compressed-tensors' decompression,
  GPTQ's and AWQ's dequantization and an FP8 checkpoint on a CPU compute
  (``pack-quantized`` W4A16 / W8A16 symmetric or not, GPTQ 4 and 8 bits with
  ``g_idx``, AWQ GEMM, ``float-quantized`` and ``fp8``).

Inputs go in chunks of 32 (:data:`CHUNK`), each in one group (``chunk_groups``):
the loader sorts the inputs of a GPTQ checkpoint with ``desc_act`` by group
and pads each group's run to whole chunks with zero columns, recording which
input each column reads (``perm``; ``in_features`` is a zero input). The kernels
then see groups as runs of whole chunks, whatever their size or order.

:func:`linear` is the reference of every quantized product: it widens the weight
(:func:`dequantize`) or quantizes the rows (:func:`quantize_rows`) as the kernels
do, and runs the product in torch. :func:`pack` hands a weight to the CPU's
kernels (:mod:`.cpu.quant_linear`) and :func:`product` runs it. No GPU kernel
computes them yet: on another device only the references do (``kernel_backend:
torch``), and :func:`iterserve.workers.dtype.decide` refuses the rest by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

W8A8, WX = "w8a8", "wx"
NUMBERS = ("int", "e4m3", "e5m2")
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
CHUNK = 32  # inputs a group's run is padded to a multiple of
INT8_SYMMETRIC_RANGE = 127.5  # compressed-tensors' symmetric int8 scale: max|x| / (255 / 2)


@dataclass(frozen=True)
class Activations:
    """How a W8A8 product's inputs are quantized to int8: dynamic (a scale from
    each row, or from all rows ``per_token=False``) or static (``scale`` and
    ``zero`` from the checkpoint), symmetric or not."""

    dynamic: bool = True
    per_token: bool = True
    symmetric: bool = True
    scale: float = 0.0  # static only
    zero: int = 0  # static, asymmetric only

    def describe(self) -> str:
        how = ("dynamic per token" if self.per_token else "dynamic per tensor") if self.dynamic \
            else "static per tensor"  # fmt: skip
        return how + ("" if self.symmetric else ", asymmetric")


@dataclass(frozen=True)
class QuantizedTensors:
    """One product's quantized weight, as the loader hands it to :func:`pack`."""

    kind: str  # W8A8 | WX
    shape: tuple[int, int]  # [out, in] of the product
    # W8A8: int8 [out, in]. WX: uint8 [out, in_padded], integers or fp8 bytes
    values: torch.Tensor
    # W8A8: fp32 [out]. WX: fp32 [out, groups]
    scales: torch.Tensor
    zeros: torch.Tensor | None = None  # WX: fp32 [out, groups], in the values' units (None: 0)
    chunk_groups: torch.Tensor | None = None  # WX: int32 [in_padded / CHUNK]
    perm: torch.Tensor | None = None  # WX: int64 [in_padded]; None: column k reads input k
    bits: int = 8
    number: str = "int"  # WX: "int", "e4m3" or "e5m2"
    activations: Activations | None = None  # W8A8

    def __post_init__(self) -> None:
        out_features, in_features = self.shape
        if self.kind == W8A8:
            assert self.values.dtype == torch.int8 and tuple(self.values.shape) == self.shape
            assert self.scales.shape == (out_features,) and self.activations is not None
        else:
            assert self.kind == WX and self.number in NUMBERS and self.bits in (4, 8)
            assert self.values.dtype == torch.uint8 and self.values.shape[0] == out_features
            padded = self.values.shape[1]
            assert padded % CHUNK == 0 and padded >= in_features
            assert self.chunk_groups is not None and self.chunk_groups.shape == (padded // CHUNK,)
            assert self.scales.dim() == 2 and self.scales.shape[0] == out_features
            assert self.zeros is None or self.zeros.shape == self.scales.shape
            assert self.perm is not None or padded == in_features

    @property
    def in_padded(self) -> int:
        return self.values.shape[1]

    def describe(self) -> str:
        """One phrase for ``/version``: ``int8 weights, activations dynamic per token``."""
        if self.kind == W8A8:
            return f"int8 weights per channel, int8 activations {self.activations.describe()}"
        what = f"{self.bits}-bit integer" if self.number == "int" else f"fp8 {self.number}"
        return f"{what} weights, 16-bit activations"


def widen_values(q: QuantizedTensors) -> torch.Tensor:
    """A WX weight's values as fp32 numbers (``[out, in_padded]``), before zero and scale."""
    if q.number == "int":
        return q.values.float()
    return q.values.view(FP8_DTYPES[q.number]).float()


def dequantize(q: QuantizedTensors, dtype: torch.dtype) -> torch.Tensor:
    """A WX weight as a dense ``[out, in_padded]`` of ``dtype``: each value
    ``(v - zero) * scale`` for its chunk's group, computed in fp32 and rounded once."""
    groups = q.chunk_groups.long().repeat_interleave(CHUNK)  # [in_padded]
    scales = q.scales.float()[:, groups]
    value = widen_values(q)
    if q.zeros is not None:
        value = value - q.zeros.float()[:, groups]
    return (value * scales).to(dtype)


def gather_inputs(x: torch.Tensor, q: QuantizedTensors) -> torch.Tensor:
    """``x`` (``[rows, in]``) as the padded weight's columns read it: ``[rows, in_padded]``."""
    if q.perm is None:
        return x
    return torch.nn.functional.pad(x, (0, 1)).index_select(1, q.perm.to(x.device))


def quantize_rows(
    x: torch.Tensor, a: Activations
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xq, scale, zero)``: ``x`` (``[rows, in]``) as int8 with one fp32 scale and
    int32 zero point a row (``[rows, 1]``), as compressed-tensors defines them
    (symmetric: ``max|x| / 127.5``; asymmetric: ``(max - min) / 255``, the zero
    mapping ``min`` to -128; a range of zero: scale 1), quantized as the kernels do:
    ``rint(x / scale) + zero``, saturated."""
    xf = x.float()
    rows = xf.shape[0]
    if not a.dynamic:
        scale = torch.full((rows, 1), a.scale)
        zero = torch.full((rows, 1), a.zero if not a.symmetric else 0, dtype=torch.int32)
    else:
        dims = (1,) if a.per_token else (0, 1)
        low = xf.amin(dim=dims, keepdim=True).clamp(max=0).expand(rows, 1)
        high = xf.amax(dim=dims, keepdim=True).clamp(min=0).expand(rows, 1)
        if a.symmetric:
            scale = torch.maximum(-low, high) / INT8_SYMMETRIC_RANGE
            zero = torch.zeros((rows, 1), dtype=torch.int32)
        else:
            scale = (high - low) / 255.0
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        if not a.symmetric:
            zero = torch.round(-128.0 - low / scale).clamp(-128, 127).to(torch.int32)
    xq = (torch.round(xf / scale) + zero).clamp(-128, 127).to(torch.int8)
    return xq, scale.float(), zero


def linear(x: torch.Tensor, q: QuantizedTensors, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of a quantized product ``x @ W.T + bias`` (``x``: ``[rows, in]``),
    in ``x``'s dtype."""
    if q.kind == W8A8:
        xq, scale, zero = quantize_rows(x, q.activations)
        w = q.values.to(torch.float64)
        sums = xq.to(torch.float64) @ w.T - zero.double() * w.sum(dim=1)  # exact integers
        out = sums.float() * (scale * q.scales.float())
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)
    weight = dequantize(q, x.dtype)
    return torch.nn.functional.linear(gather_inputs(x, q), weight, bias)


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized product's weight as one device's kernel reads it, made once at
    load (:func:`pack`): ``kernel`` names the kernel (a row of the CPU dispatch
    table, or the Triton kernel), ``data`` is what it reads."""

    kernel: str
    shape: tuple[int, int]  # [out, in]
    data: Any = field(repr=False)
    describe: str = ""

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return product(x, self, bias)


def pack(q: QuantizedTensors, device: torch.device | str, dtype: torch.dtype,
         backend: str = "auto") -> QuantizedWeight:  # fmt: skip
    """``q`` laid out for the kernels of ``device`` that compute in ``dtype``;
    ``backend`` "torch" (the references only): :func:`linear` on ``q`` itself."""
    if backend == "torch":
        return QuantizedWeight("reference", q.shape, q, f"{q.describe()} (reference)")
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantized weights on {device}: only the CPU's kernels and the torch "
                         "references (kernel_backend: torch) compute them")  # fmt: skip
    from .cpu import quant_linear

    return quant_linear.pack(q, dtype)


def product(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` on ``weight``'s kernel."""
    if weight.kernel == "reference":
        return linear(x, weight.data, bias)
    from .cpu import quant_linear

    return quant_linear.product(x, weight, bias)
