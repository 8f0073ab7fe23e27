"""Sliding windows and soft-capped scores in paged attention: every backend
against dense fp64 attention, and blocks before a window never read.

Windows are chosen around the shapes' edges: shorter than a block, a block
exactly, shorter than a decode row's context, longer than every sequence."""

import pytest
import torch

from iterserve.kernels import get_ops
from iterserve.kernels import reference as ref
from iterserve.scheduler.blocks import blocks_before_window
from tests.kernels.attention_cases import DECODE, DEVICE, MIXED, TOL, dense_attention, make_batch

triton_attention = pytest.importorskip("iterserve.kernels.triton_attention")
EDGES = [(63, 1), (64, 1), (65, 1), (0, 1), (127, 1), (300, 1), (10, 3)]
WINDOWS = [3, 16, 33, 1000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["mixed", "decode"])
def test_reference_window_and_soft_cap_match_dense(window, soft_cap, shape):
    b = make_batch(shape, 8, 2, 32, 16, torch.float32, seed=21)
    got = ref.paged_attention(*b.args(), window=window, soft_cap=soft_cap)
    want = dense_attention(b, window, soft_cap)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_blocks_before_the_window_are_never_read(backend):
    """The scheduler hands on the blocks no row can reach: what they hold (here
    NaN, or an index past the cache) must not matter."""
    window = 20
    b = make_batch(MIXED + [(70, 2), (200, 1)], 8, 2, 32, 16, torch.float32, seed=22)
    want = dense_attention(b, window)
    starts = b.query_start_loc.tolist()
    for s, seq_len in enumerate(b.seq_lens.tolist()):
        q_len = starts[s + 1] - starts[s]
        gone = blocks_before_window(seq_len - q_len, window, 16)
        if gone:
            b.k_cache[b.block_tables[s, :gone].long()] = float("nan")
            b.v_cache[b.block_tables[s, :gone].long()] = float("nan")
    got = get_ops(backend).paged_attention(*b.args(), window=window)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 1)])
def test_triton_prefill_and_decode_kernels_with_a_window(window, soft_cap, num_heads,
                                                         num_kv_heads):  # fmt: skip
    b = make_batch(MIXED + [(70, 2), (200, 1)], num_heads, num_kv_heads, 32, 16, torch.float32,
                   seed=23)  # fmt: skip
    kw = dict(window=window, soft_cap=soft_cap)
    got = triton_attention.paged_attention(*b.args(), max_query_len=19, **kw)
    torch.testing.assert_close(got, ref.paged_attention(*b.args(), **kw), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3, 7])
@pytest.mark.parametrize("window", [33, 100])
def test_triton_split_decode_cuts_the_window(dtype, num_splits, window):
    from tests.kernels.test_kernel_attention import decode_plan

    b = make_batch(EDGES, 8, 2, 64, 16, dtype, seed=24)
    kw = dict(window=window, soft_cap=30.0)
    got = triton_attention.run_plan(decode_plan(8, 2, num_splits, prefill=False), *b.args(), **kw)
    torch.testing.assert_close(got, ref.paged_attention(*b.args(), **kw), **TOL[dtype])


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 32)])
def test_triton_prefill_tiles_start_inside_the_window(block_m, block_n):
    b = make_batch(MIXED, 4, 2, 64, 16, torch.float32, seed=25)
    got = triton_attention.paged_attention_launch(*b.args(), block_m=block_m, block_n=block_n,
                                                  window=7)  # fmt: skip
    torch.testing.assert_close(got, ref.paged_attention(*b.args(), window=7), **TOL[torch.float32])


def test_bad_window_and_soft_cap_are_refused():
    b = make_batch(DECODE, 2, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="window must be None or a positive int"):
        ref.paged_attention(*b.args(), window=0)
    with pytest.raises(ValueError, match="soft_cap must be None or a positive number"):
        get_ops("cpu").paged_attention(*b.args(), soft_cap=-1.0)


def test_plan_splits_a_windowed_decode_by_the_window():
    from iterserve.kernels.attention_plan import plan_attention

    kw = dict(num_tokens=1, num_seqs=1, num_heads=32, num_kv_heads=8, head_dim=128,
              max_seq_len=32768, max_query_len=1)  # fmt: skip
    assert plan_attention(**kw).num_splits == 64  # MAX_SPLITS
    assert plan_attention(**kw, window=512).num_splits == 3  # ~600 positions, 256 a split


assert DEVICE in ("cpu", "cuda")


def test_cpu_backend_attends_windowed_decodes_on_its_kernels(monkeypatch):
    """A window longer than every sequence masks nothing: the kernels compiled
    without a window serve it (no row's start is passed); once a sequence passes
    it, those compiled with one. Neither calls the reference."""
    from iterserve.kernels.cpu import attention_rows

    b = make_batch(DECODE, 8, 2, 32, 16, torch.float32, seed=26)
    longest = max(b.seq_lens.tolist())
    calls, real = [], ref.paged_attention
    monkeypatch.setattr(ref, "paged_attention",
                        lambda *a, **kw: calls.append(kw["window"]) or real(*a, **kw))  # fmt: skip
    starts, real_rows = [], attention_rows.attend_rows
    monkeypatch.setattr(attention_rows, "attend_rows",
                        lambda *a: starts.append(a[5] is not None) or real_rows(*a))  # fmt: skip
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the serial loop
    ops = get_ops("cpu")
    for window in (longest, longest - 1, 5):
        got = ops.paged_attention(*b.args(), max_seq_len=longest, window=window)
        torch.testing.assert_close(got.double(), dense_attention(b, window), atol=1e-5, rtol=1e-5)
    assert calls == [] and starts == [False, True, True]
