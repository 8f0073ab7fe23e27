"""The compiled CPU LoRA kernel against each segment's own products: fused targets
of different ranks (one not adapted), segments not a multiple of the tile long,
rows outside every segment left alone, fp32 and bf16, one and two threads."""

import numpy as np
import pytest
import torch

from iterserve.kernels import cpu_lora

if not cpu_lora.available(torch.float32):
    pytest.skip("numba is not installed", allow_module_level=True)

# q | k | v of widths 24, 8, 8 and rank up to 8; slot 2 has no k.
COLS = np.array([0, 24, 32, 40], dtype=np.int64)
RANKS = np.array([[8, 8, 8], [3, 0, 5], [1, 2, 7]], dtype=np.int64)
RMAX, IN = 8, 20
SEGMENTS = [(0, 1, 6), (2, 6, 7), (1, 9, 22)]  # (slot index, start, end); rows 0, 7, 8 base


def reference(x, out, a, b):
    want = out.double()
    for slot, start, end in SEGMENTS:
        for t in range(len(COLS) - 1):
            r, c0, c1 = int(RANKS[slot, t]), int(COLS[t]), int(COLS[t + 1])
            at = a[slot, t * RMAX : t * RMAX + r].double()  # [r, in]
            bt = b[slot, :r, c0:c1].double()
            want[start:end, c0:c1] += x[start:end].double() @ at.t() @ bt
    return want


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_segment_gets_its_slots_delta_and_base_rows_none(dtype, tol, threads):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, IN, generator=g).to(dtype)
    out = torch.randn(24, int(COLS[-1]), generator=g).to(dtype)
    a = (torch.randn(3, 3 * RMAX, IN, generator=g) / IN**0.5).to(dtype)
    b = (torch.randn(3, RMAX, int(COLS[-1]), generator=g) / RMAX**0.5).to(dtype)
    want = reference(x, out, a, b)
    got = out.clone()
    cpu_lora.lora_add(x, got, a, b, RANKS, cpu_lora.tiles(SEGMENTS), COLS, RMAX, threads)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    for row in (0, 7, 8, 22, 23):
        assert torch.equal(got[row], out[row])
