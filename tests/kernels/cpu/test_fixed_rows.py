"""A batch-invariant engine's products (kernels/cpu/fixed_rows.py): a row's outputs
are the same bits whatever the number of rows beside it, its place among them and
what they hold; the default mode's are not. Checked at every instruction-set level
this CPU can be capped to, on one thread and two."""

import json
import os
import subprocess
import sys

import pytest
import torch

from iterserve.kernels.cpu import amx_linear, dispatch, fixed_rows, isa, linear

from .levels import at_level

# The 144M Llama's product shapes ([out, in]) and a small one that pads rows.
SHAPES = [(1536, 1024), (1024, 2816), (96, 64)]
ROW_COUNTS = [1, 2, 5, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 128, 257, 300]


def differing_rows(weight, kernel_rows, *, bias=None) -> list[tuple[int, int]]:
    """(rows, position) where a row computed among ``rows`` others at ``position``
    differs from the same row computed alone (``kernel_rows(x)``: the product)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(max(ROW_COUNTS), weight.shape[1], generator=gen).to(weight.dtype)
    alone = kernel_rows(x[:1])[0]
    found = []
    for rows in ROW_COUNTS:
        for position in sorted({0, rows // 2, rows - 1}):
            batch = x[:rows].clone()
            batch[position] = x[0]
            if not torch.equal(kernel_rows(batch)[position], alone):
                found.append((rows, position))
    return found


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_invariant_product_computes_each_row_as_it_computes_it_alone(dtype, shape, threads):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=gen).to(dtype)
    packed = linear.pack(weight, invariant=True)
    if packed is None:
        pytest.skip("no oneDNN packing in this build")
    bias = torch.randn(shape[0], generator=gen).to(dtype)
    assert differing_rows(weight, lambda x: linear.linear(x, weight, None, packed)) == []
    assert differing_rows(weight, lambda x: linear.linear(x, weight, bias, packed)) == []
    # and each row is the product's, to rounding
    x = torch.randn(40, shape[1], generator=gen).to(dtype)
    got = linear.linear(x, weight, bias, packed).float()
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, rtol=tol, atol=tol * shape[1] ** 0.5)


def test_the_default_mode_rounds_a_row_by_its_batch():
    """What the mode exists for: oneDNN's kernels for other row counts sum otherwise."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1024, 2816, generator=gen)
    packed = linear.pack(weight)
    if packed is None:
        pytest.skip("no oneDNN packing in this build")
    assert differing_rows(weight, lambda x: linear.linear(x, weight, None, packed)) != []


def test_bf16_on_amx_takes_the_amx_kernel_at_any_row_count(monkeypatch):
    if not amx_linear.available():
        pytest.skip("no AMX on this CPU")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    weight = torch.randn(1024, 1024).to(torch.bfloat16)
    packed = linear.pack(weight, invariant=True)
    calls = []
    monkeypatch.setattr(fixed_rows, "onednn_blocks", lambda *a: calls.append("onednn"))
    monkeypatch.setitem(fixed_rows.KERNELS, "onednn_blocks", fixed_rows.onednn_blocks)
    for rows in (1, 64, 65, 300, 600):
        x = torch.randn(rows, 1024).to(torch.bfloat16)
        out = linear.linear(x, weight, None, packed)
        # blocks of AMX_ROWS rows: the same bits as the kernel over all rows at once
        assert torch.equal(out, amx_linear.product(x, packed.amx, 1024))
    assert calls == []


def test_the_table_gives_an_invariant_call_a_fixed_row_kernel_at_every_level():
    invariant, tileable = frozenset({"invariant"}), frozenset({"invariant", "tileable"})
    for level in isa.LEVELS:
        table = dispatch.Dispatch(level)
        for name in (dispatch.FP32, dispatch.BF16):
            assert table.kernel("linear", name, invariant) == "onednn_blocks"
            assert table.kernel("linear", name, invariant | {"few"}) == "onednn_blocks"
        amx = isa.at_least(level, "amx")
        assert table.kernel("linear", dispatch.BF16, tileable) == (
            "amx_blocks" if amx else "onednn_blocks"
        )
        assert table.kernel("linear", dispatch.FP32, tileable) == "onednn_blocks"


def test_a_lower_level_falls_back_to_onednn_blocks(monkeypatch):
    at_level(monkeypatch, "avx512_bf16")
    weight = torch.randn(1536, 1024).to(torch.bfloat16)
    packed = linear.pack(weight, invariant=True)
    if packed is None:
        pytest.skip("no oneDNN packing in this build")
    assert differing_rows(weight, lambda x: linear.linear(x, weight, None, packed)) == []


_LEVEL_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {root!r})
from tests.kernels.cpu.test_fixed_rows import differing_rows
from iterserve.kernels.cpu import isa, linear
torch.set_num_threads(2)
found = {{}}
for dtype in (torch.float32, torch.bfloat16):
    weight = torch.randn(1024, 2816, generator=torch.Generator().manual_seed(0)).to(dtype)
    packed = linear.pack(weight, invariant=True)
    if packed is not None:
        found[str(dtype)] = differing_rows(weight, lambda x: linear.linear(x, weight, None, packed))
print(json.dumps({{"level": isa.level(), "found": found}}))
"""


@pytest.mark.parametrize("level", ["avx512_bf16", "avx512", "avx2"])
def test_oneDNN_capped_to_a_lower_level_keeps_rows_apart(level):
    """oneDNN runs other kernels under ITERSERVE_CPU_ISA (read once a process)."""
    if not isa.at_least(isa.hardware(), level):
        pytest.skip(f"this CPU runs below {level}")
    env = {**os.environ, isa.ENV_VAR: level}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    script = _LEVEL_SCRIPT.format(root=root)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600, check=True)  # fmt: skip
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["level"] == level
    assert report["found"] and all(rows == [] for rows in report["found"].values())
