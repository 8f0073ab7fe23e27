"""bf16 matrix products of up to 64 rows in AMX tiles, on oneDNN's packed weights.

A decode step's products read every weight once for a few dozen rows, so they
are bound by how fast one core streams the weights from memory. oneDNN's AMX
kernel reads a bf16 weight packed for it (``cpu_linear.pack``) at ~9–11 GB/s
from memory at 32–64 rows, and a call costs ~15 µs before it multiplies. This
kernel reads the same packed weight, in place, and multiplies as oneDNN does
(``tdpbf16ps``, fp32 sums over the reduced dimension in order, rounded to bf16
once): equal to oneDNN's output but for the last bit of a few values.

oneDNN lays a bf16 weight ``[out, in]`` out for AMX in panels of 32 outputs:
for each pair of inputs, the 32 outputs' two values side by side (128 bytes).
Sixteen such rows at a 128-byte stride are one right-hand tile (16 pairs of
inputs by 16 outputs); the panel's other 16 outputs are the tile 64 bytes on.
Whether a packed weight is laid out so is checked when it is packed
(:func:`read_weight`: a product of random rows against oneDNN's own), so a
oneDNN that packs otherwise keeps its own products.

The tiles: four fp32 sums (32 rows by 32 outputs: tmm0..tmm3), two tiles of the
rows' inputs (tmm4, tmm5) and the panel's two tiles of the weight (tmm6,
tmm7), a 2x2 block: each tile loaded feeds two products, the most the eight
tiles allow (a tile load costs about three products here, so loads, not
products, bound the kernel). Each panel of the weight is read from memory once
and kept in L2 for the second 32 rows of a 64-row batch. That loop,
:func:`block_pass`, is every AMX product's: the int8 and the widened-weight
products of quantized checkpoints (:mod:`.amx_quant`) run it on their own tiles.

On a 2-vCPU Xeon with AMX, one core, the weights read from memory (copies of
600 MB cycled), against oneDNN's product on the same packed weight:
1024 → 5632 at 32 rows 0.92 against 1.04 ms, at 64 rows 1.15 against 1.22;
1024 → 1536 0.26 against 0.31 and 0.32 against 0.37; 2816 → 1024 0.45 against
0.53 and 0.55 against 0.60. A decode step of the 144M Llama (everything, the
two alternating in one process): 64 rows 0.92x the time, 32 rows 0.86x
(docs/kernels.md).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from . import amx as cpu_amx

# The most rows a product takes here; oneDNN's products are faster beyond.
MAX_ROWS = 64
# A panel of the packed weight: this many outputs, two values of each per pair of
# inputs; the inputs go 32 (a tile's width in bf16) at a time.
PANEL = 32
BF16_CHUNK = 32  # inputs a bf16 tile row reads

if cpu_amx.numba is not None:
    _zero_00, _zero_01, _zero_10, _zero_11 = (cpu_amx._zero(t) for t in range(4))
    _load_rows0, _load_rows1 = cpu_amx._load(4), cpu_amx._load(5)
    _load_weight0, _load_weight1 = cpu_amx._load(6), cpu_amx._load(7)
    _f00, _f01 = cpu_amx._product(0, 4, 6), cpu_amx._product(1, 4, 7)
    _f10, _f11 = cpu_amx._product(2, 5, 6), cpu_amx._product(3, 5, 7)
    _i00, _i01 = cpu_amx._int8_product(0, 4, 6), cpu_amx._int8_product(1, 4, 7)
    _i10, _i11 = cpu_amx._int8_product(2, 5, 6), cpu_amx._int8_product(3, 5, 7)
    _store_00, _store_01, _store_10, _store_11 = (cpu_amx._store(t) for t in range(4))
    from .tiles import round_rows_tile


_jit = cpu_amx._jit


@_jit
def configure_passes(config, rows):
    """The tiles configured for passes of 32 of ``rows`` rows, once for them all where
    every pass has the same rows (one pass, or whole passes of 32): True then, and
    :func:`block_pass` configures nothing; else it configures each pass."""
    once = rows <= 32 or rows % 32 == 0
    if once:
        cpu_amx.configure_block(config, min(rows, 16), min(max(rows - 16, 0), 16))
    return once


@_jit
def block_pass(config, once, rows, first, count, width, chunk, weight, base, step, right, sums,
               int8):  # fmt: skip
    """One pass of the 2x2 block, the products' one loop: ``count`` (1-32) rows of
    ``rows`` (flat, ``width`` elements a row) from row ``first`` times one panel of
    ``weight``, whose chunk ``k`` (``chunk`` inputs) starts at element
    ``base + k * step``, its second tile ``right`` elements on; the sums into
    ``sums`` (32 x 32): int32 of int8 tiles (``int8`` not None), fp32 of bf16 ones.
    The tiles are configured for ``count`` rows first unless :func:`configure_passes`
    did (``once``). No chunk is fetched ahead by hand: the weights stream in order,
    and the hardware's prefetcher kept up as well as fetches 4 to 32 KiB ahead did
    (bf16 and int8, the 144M Llama's products at 1, 32 and 64 rows)."""
    if not once:
        cpu_amx.configure_block(config, min(count, 16), max(count - 16, 0))
    two = count > 16
    row_bytes = width * rows.itemsize
    _zero_00()
    _zero_01()
    if two:
        _zero_10()
        _zero_11()
    for k in range(width // chunk):
        at = base + k * step
        _load_rows0(rows, first * width + k * chunk, row_bytes)
        _load_weight0(weight, at, 128)
        _load_weight1(weight, at + right, 128)
        if int8 is None:
            _f00()
            _f01()
        else:
            _i00()
            _i01()
        if two:
            _load_rows1(rows, (first + 16) * width + k * chunk, row_bytes)
            if int8 is None:
                _f10()
                _f11()
            else:
                _i10()
                _i11()
    _store_00(sums, 0, 128)
    _store_01(sums, 16, 128)
    if two:
        _store_10(sums, 16 * 32, 128)
        _store_11(sums, 16 * 32 + 16, 128)


@_jit
def _product(x, weight, out):
    """``out = x @ W.T`` rounded to bf16, for bf16 ``x`` ``[rows, in]`` (its bits;
    any number of rows, 32 a pass) and ``weight`` oneDNN's packing of ``W``
    ``[out, in]`` (bits, flat), ``out`` ``[rows, out]`` (bits); ``in`` and ``out``
    multiples of 32. A panel's passes one after the other: its weight is read from
    memory in the first, from L2 in the others."""
    rows, width = x.shape
    outputs = out.shape[1]
    sums = np.empty(32 * 32, dtype=np.float32)
    config = np.empty(64, dtype=np.uint8)
    x_flat, out_flat = x.reshape(-1), out.reshape(-1)
    once = configure_passes(config, rows)
    for panel in range(outputs // PANEL):
        for first in range(0, rows, 32):
            count = min(32, rows - first)
            # a chunk: 16 pairs of inputs by 32 outputs
            block_pass(config, once, x_flat, first, count, width, BF16_CHUNK, weight,
                       panel * width * PANEL, 1024, 32, sums, None)  # fmt: skip
            round_rows_tile(sums, 0, 32, count, out_flat, first * outputs + panel * PANEL,
                            outputs, 2)  # fmt: skip
    cpu_amx.release_tiles()


def product(x: torch.Tensor, weight: np.ndarray, outputs: int) -> torch.Tensor:
    """``x @ W.T`` for contiguous bf16 ``x`` of 1..:data:`MAX_ROWS` rows and
    ``weight`` from :func:`read_weight` (``W`` of ``outputs`` rows), as bf16."""
    out = torch.empty((x.shape[0], outputs), dtype=torch.bfloat16)
    _product(x.view(torch.uint16).numpy(), weight, out.view(torch.uint16).numpy())
    return out


def available() -> bool:
    """Whether this process runs the kernel: AMX-BF16 tiles (:func:`.cpu_amx.available`)."""
    return cpu_amx.available()


def read_weight(packed: torch.Tensor) -> np.ndarray | None:
    """``packed`` (``linear.pack``'s oneDNN layout of a bf16 weight) as the flat bits
    :func:`product` reads, or None where the kernel does not take it: no AMX,
    outputs or inputs not a multiple of 32, or a layout not the one this kernel
    reads (a product of random rows differs from oneDNN's). Asked once a weight,
    when it is packed, so that no step does."""
    outputs, inputs = packed.shape
    if (
        not available()
        or packed.dtype != torch.bfloat16
        or packed.layout != torch._mkldnn
        or outputs % PANEL
        or inputs % 32
    ):
        return None
    if torch.ops.mkldnn._nbytes(packed) != outputs * inputs * 2:
        return None
    address = torch.ops.mkldnn.data_ptr(packed)
    array = np.frombuffer((ctypes.c_uint16 * (outputs * inputs)).from_address(address),
                          dtype=np.uint16)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(MAX_ROWS, inputs, generator=gen).to(torch.bfloat16)
    ours = product(probe, array, outputs).float()
    theirs = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "").float()
    # the same sums in the same order: equal but for the last bit of a few values
    return array if torch.allclose(ours, theirs, rtol=2**-7, atol=1e-3) else None
