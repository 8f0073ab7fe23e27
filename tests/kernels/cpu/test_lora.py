"""The compiled CPU LoRA kernel against each segment's own products: fused targets
of different ranks (one not adapted), segments not a multiple of the tile long,
rows outside every segment left alone, fp32 and bf16, one and two threads; output
columns in whole tiles of 32 and past them, ranks under, at and over 16."""

import numpy as np
import pytest
import torch

from iterserve.kernels.cpu import lora as cpu_lora

if not cpu_lora.available(torch.float32):
    pytest.skip("numba is not installed", allow_module_level=True)

SEGMENTS = [(0, 1, 6), (2, 6, 7), (1, 9, 22)]  # (slot index, start, end); rows 0, 7, 8 base
# Per case: each target's output width, the largest rank, the slots' ranks by target.
CASES = {
    # q | k | v of widths 24, 8, 8 (no whole tile of 32); slot 1 has no k.
    "narrow": ([24, 8, 8], 8, [[8, 8, 8], [3, 0, 5], [1, 2, 7]]),
    # gate | up of 96 and 40 (whole tiles, then 8 columns past them); ranks to 20.
    "tiles": ([96, 40], 20, [[16, 20], [1, 0], [17, 5]]),
}
IN = 20


def layout(a_rows: torch.Tensor, rmax: int) -> torch.Tensor:
    """``[slots, T * rmax, in]`` (A by rank) as the kernel's ``[slots, T, in, rpad]``."""
    slots, rows, num_in = a_rows.shape
    a = torch.zeros(slots, rows // rmax, num_in, cpu_lora.padded_rank(rmax), dtype=a_rows.dtype)
    a[..., :rmax] = a_rows.view(slots, rows // rmax, rmax, num_in).transpose(2, 3)
    return a


def reference(x, out, a_rows, b, cols, ranks, rmax):
    want = out.double()
    for slot, start, end in SEGMENTS:
        for t in range(len(cols) - 1):
            r, c0, c1 = int(ranks[slot, t]), int(cols[t]), int(cols[t + 1])
            at = a_rows[slot, t * rmax : t * rmax + r].double()  # [r, in]
            bt = b[slot, :r, c0:c1].double()
            want[start:end, c0:c1] += x[start:end].double() @ at.t() @ bt
    return want


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_segment_gets_its_slots_delta_and_base_rows_none(case, dtype, tol, threads):
    widths, rmax, ranks = CASES[case]
    cols = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
    ranks = np.array(ranks, dtype=np.int64)
    targets, width = len(widths), int(cols[-1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, IN, generator=g).to(dtype)
    out = torch.randn(24, width, generator=g).to(dtype)
    a_rows = (torch.randn(3, targets * rmax, IN, generator=g) / IN**0.5).to(dtype)
    b = (torch.randn(3, rmax, width, generator=g) / rmax**0.5).to(dtype)
    a = layout(a_rows, rmax)
    # Lanes past a slot's rank hold another adapter's weights: never read into out.
    a[..., rmax:] = 7.0
    for slot in range(3):
        for t in range(targets):
            a[slot, t, :, int(ranks[slot, t]) : rmax] = 5.0
    want = reference(x, out, a_rows, b, cols, ranks, rmax)
    got = out.clone()
    cpu_lora.lora_add(x, got, a, b, ranks, cpu_lora.tiles(SEGMENTS), cols, threads)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    for row in (0, 7, 8, 22, 23):
        assert torch.equal(got[row], out[row])
