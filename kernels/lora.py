"""LoRA shrink and expand over a batch segmented by adapter: the torch reference.

A step's rows are ordered by adapter, so each adapter's rows are one segment
``[start, start + len)`` of the flat batch (punica's and S-LoRA's SGMV layout).
The adapters' weights are stacked, one matrix per slot::

    a: [num_slots, in, R]     (A^T of each adapter, ranks zero-padded to R)
    b: [num_slots, R, out]    (B^T, scaled)

    shrink:  s[seg]    = x[seg] @ a[slot]       for every segment
    expand:  out[seg] += s[seg] @ b[slot]

Rows in no segment (the base model's) are left alone: ``shrink`` writes zeros
there, ``expand`` does not touch them. :mod:`.triton_lora` has the kernels
with the same signatures.
"""

from __future__ import annotations

import torch


def check_segments(num_rows: int, num_slots: int, starts: list[int], lens: list[int],
                   slots: list[int]) -> None:  # fmt: skip
    """Segments in range, not overlapping, naming existing slots."""
    if not len(starts) == len(lens) == len(slots):
        raise ValueError("starts, lens and slots must have one entry per segment")
    end = 0
    for start, n, slot in sorted(zip(starts, lens, slots)):
        if start < end or n < 0 or start + n > num_rows:
            raise ValueError(f"segment [{start}, {start + n}) overlaps or leaves the batch")
        if not 0 <= slot < num_slots:
            raise ValueError(f"segment slot {slot} outside [0, {num_slots})")
        end = start + n


def lora_shrink(x: torch.Tensor, a: torch.Tensor, starts: list[int], lens: list[int],
                slots: list[int]) -> torch.Tensor:  # fmt: skip
    """``[num_rows, R]``: each segment's rows times its slot's ``a``; zeros elsewhere."""
    check_segments(x.shape[0], a.shape[0], starts, lens, slots)
    s = torch.zeros(x.shape[0], a.shape[2], dtype=x.dtype, device=x.device)
    for start, n, slot in zip(starts, lens, slots):
        s[start : start + n] = x[start : start + n] @ a[slot]
    return s


def lora_expand(s: torch.Tensor, b: torch.Tensor, out: torch.Tensor, starts: list[int],
                lens: list[int], slots: list[int]) -> torch.Tensor:  # fmt: skip
    """Adds each segment's ``s`` rows times its slot's ``b`` to ``out`` (in place)."""
    check_segments(s.shape[0], b.shape[0], starts, lens, slots)
    for start, n, slot in zip(starts, lens, slots):
        out[start : start + n] += s[start : start + n] @ b[slot]
    return out
