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
:func:`linear` runs a cliff batch on a weight between those bounds as 33 rows,
the extra rows zeros and their outputs dropped.

Not every CPU with AMX has the cliff: on another Xeon (2 vCPUs, the same
figures' method) 32 rows took 2.27–2.33 ms a layer of the 144M model's
products against 2.25–2.40 at 33, and padding only cost the copy (a 32-row
decode step 1.3–3 ms slower with it). So whether this CPU has it is measured
once per process, on the first weight that qualifies (:func:`_cliff_here`:
32-row products alternating with the same rows padded to 33, copy included,
on copies of it too large for the caches, ~0.1 s), and batches are padded
only where the padded product comes out clearly faster.

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
thread runs on :mod:`.cpu_amx_linear`'s kernel instead, which reads the same
packed weight in place: 0.81–0.95x oneDNN's time at 1–64 rows on the 144M
model's weights read from memory, and a call costs a numba dispatch rather than
oneDNN's ~15 µs. A product with a bias, or a weight whose layout that kernel
does not read (checked when it is packed), stays oneDNN's.

fp32 and bf16 CPU weights, and only where the build has oneDNN; anywhere else
:func:`pack` returns ``None`` and :func:`linear` is ``F.linear``.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Below this many rows the plain fp32 product is the faster (dispatch dominates).
MIN_ROWS = 16
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The batch size oneDNN is told to expect when it lays the weight out.
_ROWS_HINT = 128
# bf16 batches of more than CLIFF_ROWS[0] and at most CLIFF_ROWS[1] rows run as
# CLIFF_ROWS[1] + 1 rows on weights of at least CLIFF_MIN_BYTES whose rows are at
# most CLIFF_MAX_IN long, on CPUs with AMX (see the module docstring).
CLIFF_ROWS = (16, 32)
# Products of more than BUCKETS_FROM rows run at the next multiple of ROW_BUCKET
# (see the module docstring: oneDNN builds a kernel per row count).
BUCKETS_FROM = 64
ROW_BUCKET = 32
CLIFF_MIN_BYTES = 2 << 20
CLIFF_MAX_IN = 4096


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (``[out, in]``) in oneDNN's layout, or ``None`` where that does
    not apply (not fp32 or bf16 on the CPU, or no oneDNN in this build)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.dim() != 2:
        return None
    packed = _reorder(weight)
    if packed is not None:
        pads_cliff_batches(weight.shape, weight.dtype)  # measured now, not in a step
        if weight.dtype == torch.bfloat16:
            _amx_products().weight_array(packed)  # its layout checked now, not in a step
    return packed


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
    """:mod:`.cpu_amx_linear`, imported once a bf16 product asks for it: it needs
    numpy and numba, which a GPU image may lack, and GPU weights are never packed."""
    from . import amx_linear as cpu_amx_linear

    return cpu_amx_linear


@functools.cache
def _has_amx() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def pads_cliff_batches(weight_shape: tuple[int, int] | torch.Size, dtype: torch.dtype) -> bool:
    """Whether :func:`linear` runs this weight's batches of 17–32 rows as 33 rows."""
    out_features, in_features = weight_shape
    return (
        dtype == torch.bfloat16
        and in_features <= CLIFF_MAX_IN
        and out_features * in_features * dtype.itemsize >= CLIFF_MIN_BYTES
        and _has_amx()
        and _cliff_here(out_features, in_features)
    )


# The padded product must take at most this share of the plain one's time: the
# cliff measured 0.68 (1.7 against 2.5 ms); without one the two are within ~10%,
# so the verdict does not hinge on the noise of a busy machine.
CLIFF_GAIN = 0.8


@functools.cache
def _cliff_here(out_features: int, in_features: int) -> bool:
    """Whether this CPU's oneDNN reads a bf16 weight of this shape so much more
    slowly at 32 rows than at 33 that padding pays: 32-row products alternate
    with padded ones on copies of such a weight (at least 24 MiB of them, so
    that each is read from memory as in a step), timed by this thread's CPU
    time; the medians decide (:data:`CLIFF_GAIN`). Asked once per shape, when
    :func:`pack` first packs a weight of it, so that no step waits for it."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    copies = max(2, -(-(24 << 20) // (weight.numel() * weight.element_size())))
    packed = [_reorder(weight.clone()) for _ in range(copies)]
    if packed[0] is None:
        return False
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
    return ratio < CLIFF_GAIN


def packs_every_batch(dtype: torch.dtype) -> bool:
    """Whether :func:`linear` takes the packed weight for every batch of ``dtype``
    (so the plain weight is no longer read once packed)."""
    return dtype == torch.bfloat16


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on ``packed`` (``pack(weight)``) when there
    is one and ``x`` is 2-D with at least :data:`MIN_ROWS` rows, any number in bf16
    (up to 64 of them without a bias on one thread by :mod:`.cpu_amx_linear`
    where it reads the packed weight)."""
    if packed is None or x.dim() != 2 or (x.shape[0] < MIN_ROWS and x.dtype == torch.float32):
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if x.dtype == torch.bfloat16 and bias is None and torch.get_num_threads() == 1:
        amx = _amx_products()
        if 0 < rows <= amx.MAX_ROWS and x.shape[1] == packed.shape[1] and x.is_cpu:
            array = amx.weight_array(packed)
            if array is not None:
                return amx.product(x.contiguous(), array, packed.shape[0])
    if CLIFF_ROWS[0] < rows <= CLIFF_ROWS[1] and pads_cliff_batches(packed.shape, x.dtype):
        return _product(x, packed, bias, CLIFF_ROWS[1] + 1)
    return _product(x, packed, bias, bucket_rows(rows))


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
