"""Long bf16 prefill pieces in AMX tiles (kernels/cpu/amx.py) equal dense
attention as torch's flash attention does, on CPUs with AMX-BF16."""

import numpy as np
import pytest
import torch

from iterserve.kernels import reference as ref
from iterserve.kernels.cpu import amx as cpu_amx
from iterserve.kernels.cpu import attention as cpu_attention
from iterserve.kernels.cpu import dispatch, isa
from iterserve.kernels.cpu import plan as cpu_plan
from iterserve.kernels.cpu import tiles as cpu_tiles
from tests.kernels.attention_cases import dense_attention, make_batch, poison_past_ends
from tests.kernels.cpu.levels import at_level
from tests.kernels.cpu.test_attention import FLASH_BF16, PIECES, on_cpu

pytestmark = pytest.mark.skipif(isa.level() != "amx", reason="the CPU lacks AMX-BF16")

# Pieces that start their sequence and that follow cached context, of whole
# 16-row blocks and not, shorter than a 32-position V tile and several of them.
AMX_PIECES = PIECES + [(0, 16), (0, 33), (100, 64), (31, 17), (0, 130), (7, 1)]


def no_flash(monkeypatch):
    """Torch's flash attention and the gather around it may not run."""
    monkeypatch.setattr(cpu_attention.F, "scaled_dot_product_attention", None)
    monkeypatch.setattr(ref, "_gather_blocks", None)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(8, 2, 64), (4, 4, 32), (12, 1, 96), (6, 3, 128), (2, 1, 256)],
)
def test_amx_pieces_attend_as_the_dense_attention(monkeypatch, block_size, num_heads,
                                                  num_kv_heads, head_dim):  # fmt: skip
    """Every group size, heads of one to eight 32-value chunks (256: the output
    in two passes of four tiles), blocks smaller and larger than a score tile."""
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", 0)  # every piece is long
    no_flash(monkeypatch)
    b = on_cpu(make_batch(AMX_PIECES, num_heads, num_kv_heads, head_dim, block_size,
                          torch.bfloat16, seed=21))  # fmt: skip
    got = cpu_attention.paged_attention(*b.args())
    want = dense_attention(b).to(torch.bfloat16).double()
    torch.testing.assert_close(got.double(), want, **FLASH_BF16)


def test_amx_agrees_with_torch_flash_attention(monkeypatch):
    """Both round the softmax weights to bf16 before they multiply V and sum in
    fp32: they differ by rounding only, not by a bf16 step of the weights."""
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", 0)
    b = on_cpu(make_batch(AMX_PIECES, 8, 2, 64, 16, torch.bfloat16, seed=22))
    amx = cpu_attention.paged_attention(*b.args())
    at_level(monkeypatch, "avx512_bf16")
    flash = cpu_attention.paged_attention(*b.args())
    torch.testing.assert_close(amx.double(), flash.double(), atol=2**-8, rtol=2**-8)
    # mostly to the bit
    assert (amx == flash).float().mean() > 0.9


def test_amx_ignores_what_slots_past_a_sequence_hold(monkeypatch):
    """The packed K and V hold zeros past a sequence's end, whatever the cache's
    last block holds there (NaN and infinities here), and those scores are
    never in a row's softmax."""
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", 0)
    no_flash(monkeypatch)
    b = on_cpu(make_batch(AMX_PIECES, 8, 2, 64, 16, torch.bfloat16, seed=23))
    want = cpu_attention.paged_attention(*b.args())
    poison_past_ends(b, 16)
    assert torch.equal(cpu_attention.paged_attention(*b.args()), want)


def test_amx_takes_large_scores(monkeypatch):
    """Scores in the hundreds: each row's softmax subtracts its largest, so none
    overflows, and rows dominated by one position give that position's V."""
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", 0)
    no_flash(monkeypatch)
    b = on_cpu(make_batch(AMX_PIECES, 8, 2, 64, 16, torch.bfloat16, seed=24))
    b.query = b.query * 40
    got = cpu_attention.paged_attention(*b.args())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), dense_attention(b).to(torch.bfloat16).double(),
                               **FLASH_BF16)  # fmt: skip


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 48)])
def test_amx_leaves_fp32_and_odd_heads_to_flash_attention(monkeypatch, dtype, head_dim):
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", 0)
    monkeypatch.setattr(cpu_amx, "attend_pieces", None)
    b = on_cpu(make_batch(PIECES, 4, 2, head_dim, 16, dtype, seed=25))
    got = cpu_attention.paged_attention(*b.args())
    tolerance = FLASH_BF16 if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), dense_attention(b).to(dtype).double(), **tolerance)


@pytest.mark.parametrize("seen", [1, 15, 16, 17, 40, 64])
def test_softmax_tile_weighs_the_positions_a_row_sees(seen):
    """Weights rounded to bf16 from the unrounded ones, whose sum it returns;
    zeros from ``seen`` to the width, whatever the scores hold there."""
    width = 64
    scores = torch.randn(width) * 3
    scores[seen:] = float("nan")
    weights = np.full(width, 0xFFFF, dtype=np.uint16)
    total = _softmax(scores.numpy(), weights, seen, width, np.float32(0.7))
    e = torch.exp((scores[:seen].double() - scores[:seen].max()) * 0.7)
    got = torch.from_numpy(weights.view(np.int16)).view(torch.bfloat16)
    torch.testing.assert_close(got[:seen].double(), e.to(torch.bfloat16).double(),
                               atol=0, rtol=2**-8)  # fmt: skip
    assert (got[seen:] == 0).all()
    assert total == pytest.approx(float(e.sum()), rel=1e-6)


if cpu_tiles.numba is not None:
    import numba

    @numba.njit
    def _softmax(scores, weights, seen, width, scale):
        return cpu_tiles.softmax_tile(scores, 0, weights, 0, seen, width, scale)


def test_amx_reads_a_strided_query_in_place(monkeypatch):
    """The query is a slice of the qkv projection's output: its tiles are loaded
    a token's stride apart, not from a contiguous copy."""
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", 0)
    no_flash(monkeypatch)
    b = on_cpu(make_batch(AMX_PIECES, 4, 2, 64, 16, torch.bfloat16, seed=26))
    wide = torch.randn(b.query.shape[0], 8, 64).to(torch.bfloat16)
    wide[:, 2:6] = b.query
    b.query = wide[:, 2:6]
    assert not b.query.is_contiguous()
    got = cpu_attention.paged_attention(*b.args())
    torch.testing.assert_close(got.double(), dense_attention(b).to(torch.bfloat16).double(),
                               **FLASH_BF16)  # fmt: skip


# Decode rows and short pieces on the tiles kernel: contexts inside one score tile,
# across blocks, at a block's edge; a short piece of a few rows.
ROWS = [(0, 1), (15, 1), (16, 1), (300, 1), (47, 1), (129, 1), (20, 3)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (16, 2), (16, 1)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (20, None), (None, 1.5)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_group_scores_in_amx_equal_the_score_tiles(monkeypatch, num_heads, num_kv_heads, window,
                                                   soft_cap, block_size):  # fmt: skip
    """Every group size AMX takes (1 to 16 query heads a KV head), with and
    without a window and a soft cap: the same scores as the vector tiles'
    (both exact bf16 products summed in fp32), so the same outputs but for the
    sums' order, and dense attention's to a bf16 step."""
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", 1 << 16)
    b = on_cpu(make_batch(ROWS, num_heads, num_kv_heads, 64, block_size, torch.bfloat16, seed=27))
    kw = dict(window=window, soft_cap=soft_cap, max_seq_len=int(b.seq_lens.max()))
    traits = dispatch.row_traits(num_heads, num_kv_heads, 64, 16)
    assert dispatch.current().kernel("attention.rows", dispatch.BF16, traits) == "amx_tiles"
    amx = cpu_attention.paged_attention(*b.args(), **kw)
    at_level(monkeypatch, "avx512_bf16")
    tiles = cpu_attention.paged_attention(*b.args(), **kw)
    torch.testing.assert_close(amx, tiles, atol=1e-6, rtol=2**-7)
    want = dense_attention(b, window, soft_cap).to(torch.bfloat16).double()
    torch.testing.assert_close(amx.double(), want, atol=1e-6, rtol=2**-7)


def test_group_scores_ignore_what_slots_past_a_sequence_hold():
    b = on_cpu(make_batch(ROWS, 8, 2, 64, 16, torch.bfloat16, seed=28))
    want = cpu_attention.paged_attention(*b.args())
    poison_past_ends(b, 16)
    assert torch.equal(cpu_attention.paged_attention(*b.args()), want)


def test_group_scores_run_on_every_thread():
    """Each of numba's threads sets up its own tiles (a thread's AMX state is its
    own): two threads attend as one."""
    b = on_cpu(make_batch(ROWS * 3, 8, 2, 64, 16, torch.bfloat16, seed=29))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = cpu_attention.paged_attention(*b.args())
        torch.set_num_threads(2)
        parallel = cpu_attention.paged_attention(*b.args())
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(parallel, serial, atol=1e-6, rtol=2**-7)
