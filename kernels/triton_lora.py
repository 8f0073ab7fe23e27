"""LoRA shrink and expand as segmented Triton kernels (SGMV, as punica and S-LoRA
lay them out); same contract as :mod:`iterserve.kernels.lora`.

One launch covers every adapter of the step. A program owns one tile of one
segment, so it reads only its adapter's weights::

    grid = (segments, row tiles of the longest segment, column tiles)
    rows:   seg 0 (slot 2) [r r r r r r r] | seg 1 (slot 1) [r r r]
    tiles:  [m0      ][m1  ]                 [m0   ] [m1: exits at once]

Both are one kernel: shrink accumulates ``x[rows] @ a[slot]`` over ``in`` in
fp32 and stores ``[rows, R]``; expand accumulates ``s[rows] @ b[slot]`` over
``R`` and adds it to ``out``, whose every element one program owns (no atomics). Rows of the
base model belong to no segment and are never read or written by expand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lora import check_segments
from .triton_ops import device_guard
from .triton_tiles import dot_precision

BLOCK_M = 16
BLOCK_K = 32
BLOCK_N = 32


@triton.jit
def _segmented_kernel(
    out_ptr,  # [num_rows, N]
    in_ptr,  # [num_rows, K]
    w_ptr,  # [num_slots, K, N]
    starts_ptr,  # [num_segments]
    lens_ptr,
    slots_ptr,
    K,
    N,
    stride_im,
    stride_ws,
    stride_wk,
    stride_om,
    ACCUMULATE: tl.constexpr,  # add to ``out`` (expand) rather than store (shrink)
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One tile of one segment: ``in[rows] @ w[slot]`` summed over ``K`` in fp32,
    stored into ``out[rows]`` or added to it."""
    seg = tl.program_id(0)
    n = tl.load(lens_ptr + seg)
    if tl.program_id(1) * BLOCK_M >= n:
        return
    start = tl.load(starts_ptr + seg).to(tl.int64)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < n, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(in_ptr + (start + rows)[:, None] * stride_im + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + slot * stride_ws + ks[:, None] * stride_wk + cols[None, :],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    ptrs = out_ptr + (start + rows)[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _segments(device, starts, lens, slots) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (starts, lens, slots))


def _check(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{what}: shapes {tuple(x.shape)} and {tuple(w.shape)} do not chain")
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"{what}: operands must share dtype and device")
    if x.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError(f"{what}: the last dimension must be contiguous")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, starts: list[int], lens: list[int],
                slots: list[int]) -> torch.Tensor:  # fmt: skip
    """``[num_rows, R]``: each segment's rows times its slot's ``a``; zeros elsewhere."""
    _check(x, a, "lora_shrink")
    check_segments(x.shape[0], a.shape[0], starts, lens, slots)
    s = torch.zeros(x.shape[0], a.shape[2], dtype=x.dtype, device=x.device)
    if not starts or not max(lens):
        return s
    grid = (len(starts), triton.cdiv(max(lens), BLOCK_M), triton.cdiv(a.shape[2], BLOCK_N))
    with device_guard(x):
        _segmented_kernel[grid](
            s, x, a, *_segments(x.device, starts, lens, slots), x.shape[1], a.shape[2],
            x.stride(0), a.stride(0), a.stride(1), s.stride(0), ACCUMULATE=False,
            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N,
            DOT_PRECISION=dot_precision(x.dtype),
        )  # fmt: skip
    return s


def lora_expand(s: torch.Tensor, b: torch.Tensor, out: torch.Tensor, starts: list[int],
                lens: list[int], slots: list[int]) -> torch.Tensor:  # fmt: skip
    """Adds each segment's ``s`` rows times its slot's ``b`` to ``out`` (in place)."""
    _check(s, b, "lora_expand")
    check_segments(s.shape[0], b.shape[0], starts, lens, slots)
    if out.shape != (s.shape[0], b.shape[2]) or out.stride(1) != 1 or out.device != s.device:
        raise ValueError(f"lora_expand: out {tuple(out.shape)} is not [rows, {b.shape[2]}]")
    if not starts or not max(lens):
        return out
    grid = (len(starts), triton.cdiv(max(lens), BLOCK_M), triton.cdiv(b.shape[2], BLOCK_N))
    with device_guard(s):
        _segmented_kernel[grid](
            out, s, b, *_segments(s.device, starts, lens, slots), b.shape[1], b.shape[2],
            s.stride(0), b.stride(0), b.stride(1), out.stride(0), ACCUMULATE=True,
            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_N, BLOCK_N=BLOCK_N,
            DOT_PRECISION=dot_precision(s.dtype),
        )  # fmt: skip
    return out
