"""Matrix products of a CPU rank on weights packed once for oneDNN.

``F.linear`` multiplies by the weight as stored, ``[out, in]``, and its
library re-blocks it on every call. oneDNN can take the weight already in the
blocked layout its kernel reads (``torch.ops.mkldnn._reorder_linear_weight``,
what torch's own CPU compiler uses for frozen weights): measured on the demo
model's shapes at 128 rows, 5–20% less time per product (the LM head 3.24 →
2.65 ms), and 8–25% at 2048 rows. A oneDNN call costs ~20 µs more to dispatch
than ``F.linear``, so an fp32 batch of fewer than :data:`MIN_ROWS` rows keeps
the plain product, which is why the plain fp32 weight stays too.

bf16 weights are packed the same way, and there the packed product wins at
every batch size (oneDNN runs it on AMX or avx512_bf16 where the CPU has them;
``F.linear`` re-blocks a 1024 × 5632 weight for every call, ~1.8× the time
at 1 to 64 rows): every bf16 product takes the packed weight, and the plain one
can be let go (:func:`packs_every_batch`), so packing costs no memory.

oneDNN's AMX kernel has a cliff: a bf16 batch of 17 to 32 rows reads a weight
streamed from memory more slowly than a batch of 33 does. Measured on a Xeon
with AMX, one core, cycling through 8 copies of each weight so that none stays
in cache: 1024 → 5632 2.5 ms a product at 32 rows against 1.7 ms at 33 (with
the padding's copy), 1024 → 1536 0.55 against 0.43, 2816 → 1024 1.35 against
0.96, 2048 → 8192 7.9 against 5.3; the whole 144M model's products per decode
step of 32 rows 59 against 39 ms, and the step 1.19× faster. Two kinds of weight
go the other way: those that fit in a core's cache (under :data:`CLIFF_MIN_BYTES`)
and long rows (8192 → 2048: 7.9 against 10.3 ms). So on CPUs with AMX,
a cliff batch on a weight between those bounds may run as 33 rows, the extra
rows zeros and their outputs dropped.

Not every CPU with AMX has the cliff: on another Xeon (2 vCPUs, the same
figures' method) 32 rows took 2.27–2.33 ms a layer of the 144M model's
products against 2.25–2.40 at 33, and padding only cost the copy (a 32-row
decode step 1.3–3 ms slower with it). So whether this CPU has it is measured
(:func:`measure_cliff`: 32-row products alternating with the same rows padded to
33, copy included, on copies of the weight too large for the caches, ~0.1 s a
shape), and batches are padded only where the padded product comes out clearly
faster. Padding changes a product's low bits, so that is a choice of the engine,
measured once by its first rank and handed to every rank
(``PackedWeight.pad_cliff``), never a rank's own timing.

oneDNN creates and compiles a kernel for each row count it is asked for, and
keeps the last 1024 (its primitive cache): a product at a row count not seen
before took ~2.6 ms per 128 rows of a 2816 × 1024 bf16 weight against 0.54 ms
at one seen already. Decode steps repeat their few row counts, but prefill
pieces and the rows routed to each expert take any count up to the step's
budget, for every weight shape: a 512-token prefill step of the 144M-shaped
Mixtral took 479 ms, its expert products (~95 ms of arithmetic at the rates
measured with a fixed row count) ~295. So a product of more than
:data:`BUCKETS_FROM` rows runs at the next multiple of :data:`ROW_BUCKET`
(zero rows appended, their outputs dropped: under 32 rows of padding, a few
percent of a product that size), which leaves 14 row counts per weight above 64.

On CPUs with AMX, a bf16 product of at most 64 rows (a decode step's) on one
thread runs on :mod:`.amx_linear`'s kernel instead, which reads the same
packed weight in place: 0.81–0.95x oneDNN's time at 1–64 rows on the 144M
model's weights read from memory, and a call costs a numba dispatch rather than
oneDNN's ~15 µs. A product with a bias, or a weight whose layout that kernel
does not read (checked when it is packed), stays oneDNN's. Which of these runs is
the dispatch table's (:mod:`.dispatch`, op ``linear``).

A batch-invariant engine's weights are packed with ``invariant``: their products
run in fixed row blocks (:mod:`.fixed_rows`), so that a row's sums never depend
on the batch, and nothing is padded or bucketed by the batch's size.

fp32 and bf16 CPU weights, and only where the build has oneDNN; anywhere else
:func:`pack` returns ``None`` and :func:`linear` is ``F.linear``. A quantized
checkpoint's weight is packed at load for its own kernels
(:class:`~iterserve.kernels.quant.QuantizedWeight`, on any device): :func:`pack`
hands it back and :func:`linear` runs it.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..quant import QuantizedWeight
from . import dispatch, fixed_rows, isa
from .memory import tensor_on_huge_pages

logger = logging.getLogger(__name__)

# Below this many rows the plain fp32 product is the faster (dispatch dominates).
MIN_ROWS = 16
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The batch size oneDNN is told to expect when it lays the weight out.
_ROWS_HINT = 128
# bf16 batches of more than CLIFF_ROWS[0] and at most CLIFF_ROWS[1] rows run as
# CLIFF_ROWS[1] + 1 rows on weights of at least CLIFF_MIN_BYTES whose rows are at
# most CLIFF_MAX_IN long, on CPUs with AMX, where measured to pay (the module docstring).
CLIFF_ROWS = (16, 32)
# Products of more than BUCKETS_FROM rows run at the next multiple of ROW_BUCKET
# (see the module docstring: oneDNN builds a kernel per row count).
BUCKETS_FROM = 64
ROW_BUCKET = 32
CLIFF_MIN_BYTES = 2 << 20
CLIFF_MAX_IN = 4096
# The padded product must take at most this share of the plain one's time: the
# cliff measured 0.68 (1.7 against 2.5 ms); without one the two are within ~10%,
# so the verdict does not hinge on the noise of a busy machine.
CLIFF_GAIN = 0.8


@dataclass(frozen=True)
class PackedWeight:
    """A product's weight as the CPU kernels read it, made once at load (:func:`pack`)."""

    onednn: torch.Tensor  # oneDNN's blocked layout of [out, in]
    amx: Any  # the AMX kernel's view of it (flat bf16 bits), or None where it does not read it
    pad_cliff: bool = False  # bf16 batches of 17-32 rows run as 33 (the engine's choice)
    invariant: bool = False  # every row summed in one order whatever the batch (the engine's)

    @property
    def shape(self) -> torch.Size:
        return self.onednn.shape


def pack(weight: torch.Tensor, pad_cliff: bool = False, invariant: bool = False
         ) -> PackedWeight | None:  # fmt: skip
    """``weight`` (``[out, in]``) laid out for this CPU's kernels, or ``None`` where
    that does not apply (not fp32 or bf16 on the CPU, or no oneDNN in this build).
    ``pad_cliff``: the engine's choice for this weight (:func:`measure_cliff`);
    ``invariant``: a batch-invariant engine's (:mod:`.fixed_rows`)."""
    quantized = getattr(weight, "quantized", None)
    if quantized is not None:  # a quantized checkpoint's weight, made at load (workers/quant)
        return quantized
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.dim() != 2:
        return None
    packed = _reorder(weight)
    if packed is None:
        return None
    tensor_on_huge_pages(packed)  # read in full every step: 2 MiB pages (.memory)
    amx = None
    if weight.dtype == torch.bfloat16 and isa.level() == "amx":
        amx = _amx_products().read_weight(packed)  # its layout checked now, not in a step
    pad_cliff = pad_cliff and not invariant and may_pad_cliff(weight.shape, weight.dtype)
    return PackedWeight(packed, amx, pad_cliff, invariant)


def _reorder(weight: torch.Tensor) -> torch.Tensor | None:
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)
    except (RuntimeError, AttributeError) as exc:  # an op this build lacks
        logger.warning("oneDNN weight packing unavailable (%s); using plain products", exc)
        return None


@functools.cache
def _amx_products():
    """:mod:`.amx_linear`, imported once a bf16 product asks for it: it needs numba,
    which a GPU image may lack, and GPU weights are never packed."""
    from . import amx_linear

    return amx_linear


def may_pad_cliff(weight_shape: tuple[int, int] | torch.Size, dtype: torch.dtype) -> bool:
    """Whether a weight of this shape and dtype is one whose 17–32-row batches the
    cliff could slow: bf16, 2 MiB or more, rows of at most 4096, on AMX."""
    out_features, in_features = weight_shape
    return (
        dtype == torch.bfloat16
        and in_features <= CLIFF_MAX_IN
        and out_features * in_features * dtype.itemsize >= CLIFF_MIN_BYTES
        and isa.level() == "amx"
    )


def measure_cliff(out_features: int, in_features: int) -> float:
    """How long this CPU's oneDNN takes for a bf16 weight of this shape at 33 rows
    (padded, copy included) against 32: 32-row products alternate with padded ones
    on copies of such a weight (at least 24 MiB of them, so that each is read from
    memory as in a step), timed by this thread's CPU time; the ratio of the
    medians. Under :data:`CLIFF_GAIN`, padding pays. The engine's first rank asks,
    once a shape, at load."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    copies = max(2, -(-(24 << 20) // (weight.numel() * weight.element_size())))
    packed = [_reorder(weight.clone()) for _ in range(copies)]
    if packed[0] is None:
        return 1.0
    x = torch.randn(CLIFF_ROWS[1], in_features, generator=gen).to(torch.bfloat16)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(5):
        for padded in (False, True):
            for w in packed:
                start = time.thread_time()
                _product(x, w, None, CLIFF_ROWS[1] + 1 if padded else CLIFF_ROWS[1])
                times[padded].append(time.thread_time() - start)
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    logger.info("bf16 %dx%d products padded to 33 rows take %.2fx the time of 32 rows: %s",
                out_features, in_features, ratio,
                "batches of 17-32 rows run as 33" if ratio < CLIFF_GAIN else "no padding")  # fmt: skip
    return ratio


def packs_every_batch(dtype: torch.dtype) -> bool:
    """Whether :func:`linear` takes the packed weight for every batch of ``dtype``
    (so the plain weight is no longer read once packed)."""
    return dtype == torch.bfloat16


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on ``packed`` (:func:`pack` of ``weight``) by
    the kernel the dispatch table picks for the call: ``plain`` (``F.linear``),
    ``amx_rows`` (:mod:`.amx_linear`), ``onednn``, or a batch-invariant engine's
    (:mod:`.fixed_rows`)."""
    if isinstance(packed, QuantizedWeight):  # its kernel was chosen when it was packed
        return packed(x, bias)
    if packed is None or x.dim() != 2:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    name = dispatch.BF16 if x.dtype == torch.bfloat16 else dispatch.FP32
    kernel = dispatch.current().kernel("linear", name, _traits(x, bias, packed))
    if kernel == "plain":
        return F.linear(x, weight, bias)
    if kernel == "amx_rows":
        return _amx_products().product(x.contiguous(), packed.amx, packed.shape[0])
    if kernel in fixed_rows.KERNELS:
        return fixed_rows.KERNELS[kernel](x, packed, bias)
    if packed.pad_cliff and CLIFF_ROWS[0] < rows <= CLIFF_ROWS[1]:
        return _product(x, packed.onednn, bias, CLIFF_ROWS[1] + 1)
    return _product(x, packed.onednn, bias, bucket_rows(rows))


_FEW, _SMALL, _NONE = frozenset({"few"}), frozenset({"small"}), frozenset()
_INVARIANT, _TILEABLE = frozenset({"invariant"}), frozenset({"invariant", "tileable"})


def _traits(x: torch.Tensor, bias, packed: PackedWeight) -> frozenset:
    """The call's shape class: ``few`` rows (under :data:`MIN_ROWS`), or ``small``
    (1–64 rows, no bias, one thread, a weight the AMX kernel reads); in a
    batch-invariant engine ``invariant``, and ``tileable`` where the AMX kernel
    takes it (``small`` but for the row count)."""
    rows = x.shape[0]
    few = rows < MIN_ROWS
    tileable = (
        packed.amx is not None and bias is None and torch.get_num_threads() == 1
        and x.shape[1] == packed.shape[1] and x.is_cpu
    )  # fmt: skip
    if packed.invariant:
        return _TILEABLE if tileable else _INVARIANT
    if tileable and 0 < rows <= _amx_products().MAX_ROWS:
        return _SMALL | _FEW if few else _SMALL
    return _FEW if few else _NONE


def bucket_rows(rows: int) -> int:
    """The row count a product of ``rows`` rows runs at: itself up to
    :data:`BUCKETS_FROM`, above it the next multiple of :data:`ROW_BUCKET`."""
    if rows <= BUCKETS_FROM:
        return rows
    return -(-rows // ROW_BUCKET) * ROW_BUCKET


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, run_rows: int):
    """The packed product of ``x``'s rows, run as ``run_rows`` rows (zeros after
    ``x``'s, their outputs dropped) where that is more."""
    rows = x.shape[0]
    if run_rows > rows:
        padded = x.new_empty(run_rows, x.shape[1])
        padded[:rows] = x
        padded[rows:].zero_()
        return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
