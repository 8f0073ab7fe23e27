"""The elementwise serving ops for CPU ranks, compiled with numba.

Each reference op is a handful of whole-tensor torch operations, and on a CPU
each of those is a pass over memory plus a dispatch of its own: a decode step
of 128 rows spends more time between the matrix products than in attention,
and the rotary embedding's broadcast multiplies alone cost a 2048-token prefill
~20 ms. These kernels do each op in one pass, row by row:

- :func:`rms_norm`: the residual add, the mean square and the scaling together;
- :func:`rotary_embedding`: query and key rotated in one call, from the cached
  cos/sin rows, without the broadcast intermediates;
- :func:`store_kv`: each token's K/V row copied into its cache slot.

``silu_mul`` stays torch's, whose vectorized exponential numba does not match.
fp32 on the CPU only (numba has no fp16/bf16 arithmetic); other dtypes and
devices take the reference path. Results agree with the reference to rounding
(sums run in another order). Compiled on first use and cached on disk.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import checks, reference
from .cpu_attention import _jit, available


def _compiled(*tensors: object) -> bool:
    """Whether the compiled kernels take these arguments (else the reference, whose
    checks name whatever is wrong with them)."""
    return available() and all(
        isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.float32
        for t in tensors
    )


# torch's SiLU is vectorized with an exponential numba's loops do not match.
silu_mul = reference.silu_mul


def _on_cpu(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.device.type == "cpu"


@_jit()
def _rms_norm_rows(x, weight, eps, out):
    rows, width = x.shape
    for i in range(rows):
        total = 0.0
        for j in range(width):
            total += x[i, j] * x[i, j]
        inv = np.float32(1.0 / math.sqrt(total / width + eps))
        for j in range(width):
            out[i, j] = weight[j] * (x[i, j] * inv)


@_jit()
def _add_rms_norm_rows(x, residual, weight, eps, out, summed):
    rows, width = x.shape
    for i in range(rows):
        total = 0.0
        for j in range(width):
            s = x[i, j] + residual[i, j]
            summed[i, j] = s
            total += s * s
        inv = np.float32(1.0 / math.sqrt(total / width + eps))
        for j in range(width):
            out[i, j] = weight[j] * (summed[i, j] * inv)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference.rms_norm` in one pass over each row."""
    if not _compiled(x, weight) or (residual is not None and not _compiled(residual)):
        return reference.rms_norm(x, weight, eps, residual)
    checks.check_rms_norm(x, weight, eps, residual)
    out = torch.empty(x.shape, dtype=x.dtype)
    if residual is None:
        _rms_norm_rows(x.numpy(), weight.numpy(), float(eps), out.numpy())
        return out
    summed = torch.empty(x.shape, dtype=x.dtype)
    _add_rms_norm_rows(
        x.numpy(), residual.numpy(), weight.numpy(), float(eps), out.numpy(), summed.numpy()
    )
    return out, summed


@_jit()
def _rotate(x, positions, cos_sin, out):
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    for t in range(tokens):
        p = positions[t]
        for h in range(heads):
            for j in range(half):
                c, s = cos_sin[p, j], cos_sin[p, half + j]
                x1, x2 = x[t, h, j], x[t, h, half + j]
                out[t, h, j] = x1 * c - x2 * s
                out[t, h, half + j] = x2 * c + x1 * s


@_jit()
def _first_outside(values, limit):
    """The index of the first value outside ``[0, limit)``, or -1."""
    for i in range(values.shape[0]):
        if values[i] < 0 or values[i] >= limit:
            return i
    return -1


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference.rotary_embedding` without its broadcast intermediates."""
    if not _compiled(query, key, cos_sin_cache) or not _on_cpu(positions):
        return reference.rotary_embedding(positions, query, key, cos_sin_cache)
    checks.check_rotary_embedding(positions, query, key, cos_sin_cache)
    pos = positions.numpy()
    bad = _first_outside(pos, cos_sin_cache.shape[0])
    if bad >= 0:
        raise IndexError(
            f"positions[{bad}]={int(pos[bad])} is outside the cos/sin cache of "
            f"{cos_sin_cache.shape[0]} positions"
        )
    cos_sin = cos_sin_cache.numpy()
    q_out = torch.empty(query.shape, dtype=query.dtype)
    k_out = torch.empty(key.shape, dtype=key.dtype)
    _rotate(query.numpy(), pos, cos_sin, q_out.numpy())
    _rotate(key.numpy(), pos, cos_sin, k_out.numpy())
    return q_out, k_out


@_jit()
def _store_rows(key, value, k_slots, v_slots, slots):
    heads, head_dim = key.shape[1], key.shape[2]
    for t in range(slots.shape[0]):
        s = slots[t]
        if s < 0:
            continue
        for h in range(heads):
            for d in range(head_dim):
                k_slots[s, h, d] = key[t, h, d]
                v_slots[s, h, d] = value[t, h, d]


@_jit()
def _largest(values):
    top = -1
    for i in range(values.shape[0]):
        top = max(top, values[i])
    return top


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`reference.store_kv`, one row copy per token."""
    if not _compiled(key, value, k_cache, v_cache) or not _on_cpu(slot_mapping):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    checks.check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    _, _, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.numpy()
    if slots.shape[0]:
        reference.check_largest_slot(int(_largest(slots)), k_cache)
    _store_rows(
        key.numpy(), value.numpy(),
        k_cache.view(-1, num_kv_heads, head_dim).numpy(),
        v_cache.view(-1, num_kv_heads, head_dim).numpy(),
        slots,
    )  # fmt: skip
