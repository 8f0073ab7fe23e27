"""The batch-invariant kernels: a query row attends to the same bits alone (a decode
row over its own positions) as in any batch of decode rows and prefill pieces,
under windows and soft caps too; Triton's fixed-tile product gives a row the same
bits among any rows; its experts likewise. cpu backend in fp32 and bf16, Triton
interpreted in fp32 and fp16 (tests/conftest.py sets TRITON_INTERPRET=1);
hypothesis draws the batches."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.kernels import attention_plan, get_ops
from iterserve.scheduler.blocks import blocks_for

BACKENDS = [("cpu", torch.float32), ("cpu", torch.bfloat16), ("triton", torch.float32),
            ("triton", torch.float16)]  # fmt: skip
IDS = [f"{b}-{str(d).removeprefix('torch.')}" for b, d in BACKENDS]


class Sequences:
    """Sequences of ``lengths`` positions, their K/V written in shuffled cache blocks
    and a query for every position: what a row at any position attends to."""

    def __init__(self, lengths, dtype, *, heads=(8, 2), head_dim=64, block_size=16, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.lengths, self.block_size = lengths, block_size
        num_heads, num_kv_heads = heads
        num_blocks = sum(blocks_for(n, block_size) for n in lengths) + 2
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(*shape, generator=gen).to(dtype)
        self.v_cache = torch.randn(*shape, generator=gen).to(dtype)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables, used = [], 0
        for n in lengths:
            self.tables.append(order[used : used + blocks_for(n, block_size)])
            used += blocks_for(n, block_size)
        self.width = max(len(t) for t in self.tables)
        self.queries = [
            torch.randn(n, num_heads, head_dim, generator=gen).to(dtype) for n in lengths
        ]

    def attend(self, ops, pieces, **kw) -> torch.Tensor:
        """One call over ``pieces`` ((sequence, first row, end) each: rows first..end-1
        of the sequence, whose KV length this step is ``end``)."""
        query = torch.cat([self.queries[s][a:b] for s, a, b in pieces])
        tables = torch.zeros(len(pieces), self.width, dtype=torch.int32)
        for i, (s, _, _) in enumerate(pieces):
            tables[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        seq_lens = torch.tensor([b for _, _, b in pieces], dtype=torch.int32)
        starts = torch.tensor([0] + [b - a for _, a, b in pieces], dtype=torch.int32).cumsum(0)
        return ops.paged_attention(query, self.k_cache, self.v_cache, tables, seq_lens,
                                   starts.to(torch.int32), 0.125, **kw)  # fmt: skip


def differing(seqs: Sequences, ops, pieces, **kw) -> list[tuple[int, int]]:
    """(sequence, position) of the rows of the batch ``pieces`` whose output is not
    the same bits as the same row attended alone, as a decode row."""
    out, row, found = seqs.attend(ops, pieces, **kw), 0, []
    for s, a, b in pieces:
        for p in range(a, b):
            if not torch.equal(out[row], seqs.attend(ops, [(s, p, p + 1)], **kw)[0]):
                found.append((s, p))
            row += 1
    return found


LENGTHS = [70, 33, 130, 5, 17]


@pytest.mark.parametrize("backend,dtype", BACKENDS, ids=IDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_row_attends_alike_in_any_batch(backend, dtype, data):
    ops = get_ops(backend, "cpu", invariant=True)
    seqs = _sequences(dtype)
    pieces = []
    for s in data.draw(st.lists(st.sampled_from(range(len(LENGTHS))), min_size=1, unique=True)):
        end = data.draw(st.integers(1, LENGTHS[s]))
        pieces.append((s, data.draw(st.integers(max(0, end - 40), end - 1)), end))
    masks = data.draw(st.sampled_from([{}, {"window": 20}, {"soft_cap": 30.0},
                                       {"window": 7, "soft_cap": 5.0}]))  # fmt: skip
    assert differing(seqs, ops, pieces, **masks) == []


@pytest.mark.parametrize("backend,dtype", BACKENDS, ids=IDS)
def test_the_default_plan_attends_a_row_by_its_batch(backend, dtype):
    """What the mode changes: the same batch without it moves some rows' bits."""
    seqs = _sequences(dtype)
    pieces = [(0, 0, 70), (1, 32, 33), (2, 0, 130), (3, 4, 5)]
    assert differing(seqs, get_ops(backend, "cpu"), pieces) != []


_CACHE: dict = {}


def _sequences(dtype) -> Sequences:
    if dtype not in _CACHE:
        _CACHE[dtype] = Sequences(LENGTHS, dtype)
    return _CACHE[dtype]


@pytest.mark.parametrize("num_seqs", [1, 4, 64, 512])
@pytest.mark.parametrize("max_seq_len", [16, 1024, 8192])
def test_the_invariant_plan_is_one_kernel_one_split_whatever_the_batch(num_seqs, max_seq_len):
    plan = attention_plan.plan_attention(
        num_tokens=num_seqs * 3, num_seqs=num_seqs, num_heads=32, num_kv_heads=8, head_dim=128,
        max_seq_len=max_seq_len, max_query_len=3, invariant=True,
    )  # fmt: skip
    assert (plan.use_decode, plan.use_prefill, plan.num_splits) == (False, True, 1)
    assert plan.tiles.prefill_block_m == plan.tiles.decode_block_m


# -------------------------------------------------------------------- products

triton_matmul = pytest.importorskip("iterserve.kernels.triton_matmul")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_fixed_tile_product_gives_a_row_the_same_bits_among_any_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(150, 80, generator=gen).to(dtype)
    alone = triton_matmul.linear(x[:1], weight, bias)[0]
    for rows in (1, 2, 31, 32, 33, 64, 65, 150):
        for position in sorted({0, rows // 2, rows - 1}):
            batch = x[:rows].clone()
            batch[position] = x[0]
            assert torch.equal(triton_matmul.linear(batch, weight, bias)[position], alone)
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(triton_matmul.linear(x, weight, bias).double(), want,
                               atol=tol * 10, rtol=tol)  # fmt: skip


def test_enable_puts_the_product_behind_torchs_mm_and_addmm():
    """In a process of its own (the override is the process's): F.linear and torch.mm
    on the key given (CPU here, CUDA in a rank) run the fixed-tile kernel."""
    script = """
import torch
from iterserve.kernels import triton_matmul
x, w, b = torch.randn(5, 80), torch.randn(96, 80), torch.randn(96)
want_mm, want_linear = triton_matmul.matmul(x, w.t()), triton_matmul.linear(x, w, b)
triton_matmul.enable("CPU")
assert torch.equal(torch.mm(x, w.t()), want_mm)
assert torch.equal(torch.nn.functional.linear(x, w, b), want_linear)
assert torch.equal(torch.addmm(b, x, w.t(), beta=2), 2 * b + want_mm)
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_invariant_experts_keep_a_token_apart_from_the_others():
    from iterserve.kernels import triton_experts

    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, inter, top_k = 4, 32, 32, 2
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / 4
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / 4
    x = torch.randn(300, hidden, generator=gen)
    ids = torch.randint(0, num_experts, (300, top_k), generator=gen)
    weights = torch.rand(300, top_k, generator=gen)
    alone = triton_experts.fused_experts(x[:1], w13, w2, ids[:1], weights[:1], invariant=True)
    for rows in (1, 7, 300):  # 300 tokens: 600 pairs, past the default mode's 256
        got = triton_experts.fused_experts(x[:rows], w13, w2, ids[:rows], weights[:rows],
                                           invariant=True)  # fmt: skip
        assert torch.equal(got[0], alone[0])
