"""LoRA shrink/expand segmented by adapter: the Triton kernels against the torch
reference (interpreted on CPU: tiny fp32 shapes), the reference against a row by
row loop, and bad segments refused."""

import pytest
import torch

from iterserve.kernels import lora
from tests.kernels.attention_cases import DEVICE

triton_lora = pytest.importorskip("iterserve.kernels.triton_lora")

# (rows, in, R, out, segments as (start, len, slot)): a base row before, between
# and after segments; a segment longer than one row tile; an empty one; slots
# out of order; R and out not multiples of the tiles.
CASES = [
    (9, 16, 8, 24, [(1, 3, 2), (5, 4, 0)]),
    (40, 48, 24, 40, [(2, 19, 1), (21, 0, 3), (22, 1, 0), (30, 10, 3)]),
    (5, 8, 16, 16, [(0, 5, 1)]),
]


def operands(rows, k, r, n, slots=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    a = torch.randn(slots, k, r, generator=g) / k**0.5
    b = torch.randn(slots, r, n, generator=g) / r**0.5
    return x.to(DEVICE), a.to(DEVICE), b.to(DEVICE)


def unpack(segments):
    return [list(v) for v in zip(*segments)] if segments else [[], [], []]


@pytest.mark.parametrize("rows, k, r, n, segments", CASES)
def test_reference_is_each_rows_own_product(rows, k, r, n, segments):
    x, a, b = (t.double() for t in operands(rows, k, r, n))
    starts, lens, slots = unpack(segments)
    s = lora.lora_shrink(x, a, starts, lens, slots)
    out = lora.lora_expand(s, b, torch.zeros(rows, n, dtype=torch.float64), starts, lens, slots)
    expected = torch.zeros(rows, n, dtype=torch.float64)
    for start, length, slot in segments:
        for row in range(start, start + length):
            expected[row] = x[row] @ a[slot] @ b[slot]
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("rows, k, r, n, segments", CASES)
def test_triton_shrink_and_expand_match_the_reference(rows, k, r, n, segments):
    x, a, b = operands(rows, k, r, n)
    starts, lens, slots = unpack(segments)
    s = triton_lora.lora_shrink(x, a, starts, lens, slots)
    torch.testing.assert_close(s, lora.lora_shrink(x, a, starts, lens, slots), atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    base = torch.randn(rows, n, device=DEVICE)
    got = triton_lora.lora_expand(s, b, base.clone(), starts, lens, slots)
    want = lora.lora_expand(s, b, base.clone(), starts, lens, slots)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    covered = {row for start, length, _ in segments for row in range(start, start + length)}
    for row in set(range(rows)) - covered:  # the base model's rows are not touched
        assert torch.equal(got[row], base[row])


def test_bad_segments_and_shapes_are_refused():
    x, a, b = operands(6, 8, 16, 16)
    for module in (lora, triton_lora):
        with pytest.raises(ValueError, match="overlaps"):
            module.lora_shrink(x, a, [0, 2], [3, 2], [0, 1])
        with pytest.raises(ValueError, match="slot 4"):
            module.lora_shrink(x, a, [0], [2], [4])
    with pytest.raises(ValueError, match="do not chain"):
        triton_lora.lora_shrink(x, b, [0], [2], [0])
