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

fp32 and bf16 CPU weights, and only where the build has oneDNN; anywhere else
:func:`pack` returns ``None`` and :func:`linear` is ``F.linear``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Below this many rows the plain fp32 product is the faster (dispatch dominates).
MIN_ROWS = 16
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The batch size oneDNN is told to expect when it lays the weight out.
_ROWS_HINT = 128


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (``[out, in]``) in oneDNN's layout, or ``None`` where that does
    not apply (not fp32 or bf16 on the CPU, or no oneDNN in this build)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.dim() != 2:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)
    except (RuntimeError, AttributeError) as exc:  # an op this build lacks
        logger.warning("oneDNN weight packing unavailable (%s); using plain products", exc)
        return None


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
    is one and ``x`` is 2-D with at least :data:`MIN_ROWS` rows, any number in bf16."""
    if packed is None or x.dim() != 2 or (x.shape[0] < MIN_ROWS and x.dtype == torch.float32):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
