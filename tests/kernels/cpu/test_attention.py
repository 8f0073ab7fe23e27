"""The cpu backend's compiled decode attention equals dense attention, in fp32 and
on bf16 caches, and the reference's output wherever it does not apply."""

import pytest
import torch

from iterserve.kernels import get_ops
from iterserve.kernels import reference as ref
from iterserve.kernels.cpu import activation, isa, jit, norm, rotary
from iterserve.kernels.cpu import attention as cpu_attention
from iterserve.kernels.cpu import plan as cpu_plan
from tests.kernels.attention_cases import (
    DECODE,
    MIXED,
    dense_attention,
    make_batch,
    poison_past_ends,
)
from tests.kernels.cpu.levels import at_level, fail_on, fail_on_loops

pytestmark = pytest.mark.skipif(not jit.available(), reason="numba is not installed")

# Decode rows with contexts inside one block, across many, at a block's edge.
LONG_DECODES = [(0, 1), (15, 1), (16, 1), (300, 1), (47, 1), (129, 1)]


def on_cpu(b):
    for name in ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"):
        setattr(b, name, getattr(b, name).cpu())
    return b


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("shape", [MIXED, DECODE, LONG_DECODES], ids=["mixed", "decode", "long"])
def test_cpu_attention_matches_dense(block_size, num_heads, num_kv_heads, shape):
    b = on_cpu(make_batch(shape, num_heads, num_kv_heads, 64, block_size, torch.float32))
    got = cpu_attention.paged_attention(*b.args())
    torch.testing.assert_close(got.double(), dense_attention(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("filler", [-1, 0])
def test_cpu_attention_reads_no_table_column_past_a_sequence(filler):
    b = on_cpu(make_batch(DECODE, 8, 2, 64, 4, torch.float32))
    for s, n in enumerate(b.seq_lens.tolist()):
        b.block_tables[s, -(-n // 4) :] = filler
    got = cpu_attention.paged_attention(*b.args())
    torch.testing.assert_close(got.double(), dense_attention(b), atol=1e-5, rtol=1e-5)


def test_cpu_attention_takes_a_strided_query():
    b = on_cpu(make_batch(MIXED, 4, 2, 64, 16, torch.float32, seed=3))
    wide = torch.randn(b.query.shape[0], 8, 64)
    wide[:, 2:6] = b.query
    b.query = wide[:, 2:6]  # a view, as the attention input is a slice of the qkv output
    assert not b.query.is_contiguous()
    got = cpu_attention.paged_attention(*b.args())
    torch.testing.assert_close(got.double(), dense_attention(b), atol=1e-5, rtol=1e-5)


def serial_and_parallel(b, **kw):
    """The batch attended with one torch thread, then with two (``kw``: a window,
    a soft cap)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = cpu_attention.paged_attention(*b.args(), **kw)
        torch.set_num_threads(2)
        return serial, cpu_attention.paged_attention(*b.args(), **kw)
    finally:
        torch.set_num_threads(threads)


def test_threads_split_the_sequences_with_the_same_results():
    """To rounding: the serial and the parallel loop are compiled apart, and fastmath
    lets each vectorize its sums its own way."""
    b = on_cpu(make_batch(LONG_DECODES * 3, 8, 2, 64, 16, torch.float32, seed=4))
    serial, parallel = serial_and_parallel(b)
    torch.testing.assert_close(parallel, serial, atol=1e-6, rtol=1e-6)


# A bf16 result is the fp32 one rounded once; sums in another order can move the
# fp32 value across a rounding boundary: one bf16 step, 2**-8 to 2**-7 of the value.
BF16_STEP = dict(atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("shape", [MIXED, DECODE, LONG_DECODES], ids=["mixed", "decode", "long"])
def test_bf16_cache_is_attended_as_the_dense_attention_of_its_values(num_heads, num_kv_heads,
                                                                     shape):  # fmt: skip
    """The kernel reads bf16 K/V and query as the exact fp32 values they hold, keeps
    its sums in fp32 and rounds the output once, as the reference does."""
    b = on_cpu(make_batch(shape, num_heads, num_kv_heads, 64, 16, torch.bfloat16, seed=9))
    got = cpu_attention.paged_attention(*b.args())
    assert got.dtype == torch.bfloat16
    want = dense_attention(b)  # the same bf16 values, in fp64
    torch.testing.assert_close(got.double(), want.to(torch.bfloat16).double(), **BF16_STEP)
    torch.testing.assert_close(got, ref.paged_attention(*b.args()), **BF16_STEP)


def test_bf16_rows_split_across_threads_alike():
    b = on_cpu(make_batch(LONG_DECODES * 3, 8, 2, 64, 16, torch.bfloat16, seed=10))
    serial, parallel = serial_and_parallel(b)
    torch.testing.assert_close(parallel, serial, **BF16_STEP)


def test_fp16_takes_the_reference_path():
    b = on_cpu(make_batch(DECODE, 4, 2, 64, 16, torch.float16, seed=5))
    assert torch.equal(cpu_attention.paged_attention(*b.args()), ref.paged_attention(*b.args()))


def test_cpu_backend_compiles_every_op():
    cpu = get_ops("cpu")
    assert cpu.name == "cpu" and cpu.paged_attention is cpu_attention.paged_attention
    assert (cpu.store_kv, cpu.rms_norm, cpu.rotary_embedding, cpu.silu_mul) == (
        rotary.store_kv, norm.rms_norm, rotary.rotary_embedding, activation.silu_mul,
    )  # fmt: skip
    assert get_ops("auto", device="cpu").name == "cpu"


# Prefill pieces: one under a block, several blocks, one whose context is cached.
PIECES = [(0, 5), (0, 40), (24, 9), (3, 1), (0, 70)]


@pytest.mark.parametrize("short_work", [0, 1 << 16], ids=["flash", "kernel"])
def test_prefill_pieces_match_dense_on_either_path(monkeypatch, short_work):
    """Pieces at most SHORT_PIECE_WORK rows x positions x heads run on the kernel, longer
    ones on torch's flash attention, with or without cached context: both are
    exact causal attention."""
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", short_work)
    b = on_cpu(make_batch(PIECES, 8, 2, 64, 16, torch.float32, seed=6))
    got = cpu_attention.paged_attention(*b.args())
    torch.testing.assert_close(got.double(), dense_attention(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_pieces_on_consecutive_blocks_read_the_cache_in_place(monkeypatch, dtype):
    """A long piece whose blocks are one run reads them as a view of the cache rather
    than a gathered copy: the same values as from shuffled blocks. (Torch's flash
    attention's path; the AMX kernel reads through the table, test_cpu_amx.py.)"""
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", 0)
    at_level(monkeypatch, "avx512_bf16")  # torch's flash attention, not AMX
    gathers = []
    real = ref._gather_blocks
    monkeypatch.setattr(ref, "_gather_blocks", lambda *a: gathers.append(1) or real(*a))
    runs, shuffled = (on_cpu(make_batch(PIECES, 8, 2, 64, 16, dtype, seed=6, consecutive=c))
                      for c in (True, False))  # fmt: skip
    in_place = cpu_attention.paged_attention(*runs.args())
    assert not gathers
    torch.testing.assert_close(in_place, cpu_attention.paged_attention(*shuffled.args()),
                               atol=0, rtol=0)  # fmt: skip
    assert gathers  # the shuffled pieces of several blocks were gathered


# torch's flash attention rounds the softmax weights to bf16 before they multiply V
# (as transformers' bf16 attention does): an output's error is then a bf16 step of
# the largest values it sums (|V| ~ 1 here), not of itself.
FLASH_BF16 = dict(atol=2**-7, rtol=2**-7)


@pytest.mark.parametrize("short_work", [0, 1 << 16], ids=["flash", "kernel"])
def test_bf16_prefill_pieces_match_dense_on_either_path(monkeypatch, short_work):
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", short_work)
    b = on_cpu(make_batch(PIECES, 8, 2, 64, 16, torch.bfloat16, seed=11))
    got = cpu_attention.paged_attention(*b.args())
    assert got.dtype == torch.bfloat16
    want = dense_attention(b).to(torch.bfloat16).double()
    torch.testing.assert_close(got.double(), want, **(FLASH_BF16 if short_work == 0 else BF16_STEP))


def test_prefill_pieces_split_across_threads_alike():
    b = on_cpu(make_batch(PIECES * 2, 4, 2, 64, 16, torch.float32, seed=7))
    serial, parallel = serial_and_parallel(b)
    torch.testing.assert_close(parallel, serial, atol=1e-6, rtol=1e-6)


def test_a_steps_plan_is_built_once_and_read_by_every_layer(monkeypatch):
    """The lengths are read once a step (KernelOps.prepare), not once a layer; a call
    without a plan reads its metadata itself, so a length written since is seen."""
    splits = []
    split = ref.split_pieces
    monkeypatch.setattr(ref, "split_pieces", lambda *a, **k: splits.append(1) or split(*a, **k))
    b = on_cpu(make_batch(MIXED, 4, 2, 64, 16, torch.float32, seed=8))
    step = cpu_plan.build(b.query.shape[0], 4, 16, *b.args()[3:6])
    first = cpu_attention.paged_attention(*b.args(), plan=step)
    assert torch.equal(cpu_attention.paged_attention(*b.args(), plan=step), first)
    assert len(splits) == 1
    b.seq_lens[0] -= 1  # one position fewer for the first decode row
    changed = cpu_attention.paged_attention(*b.args())
    assert len(splits) == 2
    torch.testing.assert_close(changed, ref.paged_attention(*b.args()), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(changed, first, atol=1e-3)


def test_a_plan_for_another_batch_shape_is_not_taken():
    b = on_cpu(make_batch(MIXED, 4, 2, 64, 16, torch.float32, seed=8))
    other = cpu_plan.build(b.query.shape[0], 8, 16, *b.args()[3:6])  # 8 heads, not 4
    got = cpu_attention.paged_attention(*b.args(), plan=other)
    torch.testing.assert_close(got.double(), dense_attention(b), atol=1e-5, rtol=1e-5)


# Windows and soft caps: compile-time specialisations of the same row kernels.
# Windows of one position, shorter than some rows' context and longer than
# others', and longer than every sequence; soft caps that bite (scores here reach
# ~±4 after scaling) and one that barely does.
@pytest.mark.parametrize("window", [None, 1, 7, 20, 1000])
@pytest.mark.parametrize("soft_cap", [None, 1.5, 30.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [MIXED, LONG_DECODES, PIECES], ids=["mixed", "long", "pieces"])
def test_windows_and_soft_caps_run_on_the_kernel_as_the_reference_computes_them(
    monkeypatch, window, soft_cap, dtype, shape
):
    """Decode rows and short prefill pieces under a sliding window and a soft cap
    run on the row kernels (never the reference) and agree with dense attention
    and the reference."""
    if window is None and soft_cap is None:
        pytest.skip("the plain kernel's case (tested above)")
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", 1 << 16)  # every piece on the kernel
    b = on_cpu(make_batch(shape, 8, 2, 64, 8, dtype, seed=12))
    b.query = b.query * 4  # scores large enough for a cap to bite
    want = ref.paged_attention(*b.args(), window=window, soft_cap=soft_cap)
    fail_on(monkeypatch, ref, "paged_attention", "attend_long_pieces")
    got = cpu_attention.paged_attention(*b.args(), window=window, soft_cap=soft_cap)
    assert got.dtype == dtype
    if dtype == torch.float32:
        dense = dense_attention(b, window, soft_cap)
        torch.testing.assert_close(got.double(), dense, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        dense = dense_attention(b, window, soft_cap).to(torch.bfloat16).double()
        torch.testing.assert_close(got.double(), dense, **BF16_STEP)
        torch.testing.assert_close(got, want, **BF16_STEP)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_and_cap_rows_split_across_threads_alike(dtype):
    b = on_cpu(make_batch(LONG_DECODES * 3 + PIECES, 8, 2, 64, 16, dtype, seed=15))
    got = serial_and_parallel(b, window=40, soft_cap=5.0)
    tolerance = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else BF16_STEP
    torch.testing.assert_close(got[1], got[0], **tolerance)
    want = ref.paged_attention(*b.args(), window=40, soft_cap=5.0)
    torch.testing.assert_close(got[0], want, **(tolerance if dtype == torch.bfloat16 else
                                                 dict(atol=1e-5, rtol=1e-5)))  # fmt: skip


def test_a_windowed_row_reads_no_block_before_its_window():
    """The scheduler may hand those blocks on: they are poisoned here, and the
    output is what it was."""
    window, block_size = 10, 4
    b = on_cpu(make_batch(LONG_DECODES + MIXED, 4, 2, 64, block_size, torch.float32, seed=13))
    want = ref.paged_attention(*b.args(), window=window)
    # a spare block nobody owns
    poison = max(set(range(b.k_cache.shape[0])) - set(b.block_tables.flatten().tolist()))
    b.k_cache[poison] = float("nan")
    b.v_cache[poison] = float("nan")
    for s, (n, q_len) in enumerate(zip(b.seq_lens.tolist(), b.q_lens, strict=True)):
        gone = max(0, n - q_len + 1 - window) // block_size  # before the first row's window
        b.block_tables[s, :gone] = poison
    got = cpu_attention.paged_attention(*b.args(), max_seq_len=int(b.seq_lens.max()),
                                        window=window)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,soft_cap", [(30, None), (None, 2.0), (30, 2.0), (1000, 2.0)])
def test_long_pieces_under_a_window_or_cap_are_attended_as_the_reference_does(
    monkeypatch, window, soft_cap
):
    """Torch's flash attention has no soft cap: long pieces take the reference's
    products, piece by piece, and the batch's short rows stay on the kernel."""
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", 8 * 40)  # pieces of > 40 positions: long
    b = on_cpu(make_batch(PIECES + LONG_DECODES, 8, 2, 64, 16, torch.float32, seed=14))
    long = []
    real = ref.attend_long_pieces
    monkeypatch.setattr(ref, "attend_long_pieces",
                        lambda *a, **k: long.append(a[4].long) or real(*a, **k))  # fmt: skip
    got = cpu_attention.paged_attention(*b.args(), window=window, soft_cap=soft_cap)
    assert long and long[0]  # some pieces were long, and attended there
    dense = dense_attention(b, window, soft_cap)
    torch.testing.assert_close(got.double(), dense, atol=1e-5, rtol=1e-5)


def test_a_window_that_cuts_no_row_runs_the_plain_specialisation():
    """No cap and no window that cuts: the rows' starts are None, so the kernels
    compiled without a window run."""
    b = on_cpu(make_batch(MIXED, 8, 2, 64, 16, torch.float32, seed=16))
    longest = int(b.seq_lens.max())
    step = cpu_plan.build(b.query.shape[0], 8, 16, *b.args()[3:6])
    assert step.row_starts(longest) is None and step.row_starts(longest - 1) is not None
    for window in (None, longest):
        got = cpu_attention.paged_attention(*b.args(), max_seq_len=longest, window=window)
        torch.testing.assert_close(got.double(), dense_attention(b), atol=1e-5, rtol=1e-5)


tiles = pytest.mark.skipif(
    not isa.at_least(isa.level(), "avx512_bf16"), reason="the CPU lacks AVX-512 BF16"
)


@tiles
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(8, 2, 64), (4, 4, 32), (12, 1, 96), (9, 1, 64), (14, 2, 128), (6, 3, 64)],
)
@pytest.mark.parametrize("shape", [MIXED, LONG_DECODES], ids=["mixed", "long"])
def test_bf16_tiles_attend_as_the_dense_attention(monkeypatch, block_size, num_heads,
                                                  num_kv_heads, head_dim, shape):  # fmt: skip
    """The register-tile kernel (on CPUs with AVX-512 BF16) for every group size a
    PV tile splits (up to 8 heads a tile, 12 as 8 + 4), heads of one to four
    32-value chunks, blocks of one and two score tiles, sequences ending inside
    a tile; the loops may not run."""
    fail_on_loops(monkeypatch)
    b = on_cpu(make_batch(shape, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16,
                          seed=11))  # fmt: skip
    serial, parallel = serial_and_parallel(b)
    want = dense_attention(b).to(torch.bfloat16).double()
    for got in (serial, parallel):
        torch.testing.assert_close(got.double(), want, **BF16_STEP)


@tiles
def test_bf16_tiles_ignore_what_slots_past_a_sequence_hold():
    """A score tile reads all 16 slots of its positions; the ones past the sequence
    (here NaN and infinities) never reach the softmax or the output."""
    b = on_cpu(make_batch(LONG_DECODES, 8, 2, 64, 16, torch.bfloat16, seed=12))
    want = cpu_attention.paged_attention(*b.args())
    poison_past_ends(b, 16)
    assert torch.equal(cpu_attention.paged_attention(*b.args()), want)


@tiles
def test_bf16_tiles_agree_with_the_loops(monkeypatch):
    b = on_cpu(make_batch(MIXED + LONG_DECODES, 8, 2, 64, 16, torch.bfloat16, seed=13))
    tiled = cpu_attention.paged_attention(*b.args())
    at_level(monkeypatch, "avx512")  # no AVX-512 BF16: the loops
    torch.testing.assert_close(tiled, cpu_attention.paged_attention(*b.args()), **BF16_STEP)


@tiles
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window,soft_cap", [(1, None), (7, None), (20, 1.5), (40, None),
                                             (None, 1.5), (1000, 30.0)])  # fmt: skip
@pytest.mark.parametrize("shape", [MIXED, LONG_DECODES, PIECES], ids=["mixed", "long", "pieces"])
def test_bf16_tiles_take_windows_and_soft_caps(monkeypatch, block_size, window, soft_cap, shape):
    """Windows starting inside a score tile, inside a later one and at a block's
    start, and soft caps, on the tiles kernel (neither the loops nor the reference
    is called)."""
    monkeypatch.setattr(cpu_plan, "SHORT_PIECE_WORK", 1 << 16)  # every piece on the kernel
    b = on_cpu(make_batch(shape, 8, 2, 64, block_size, torch.bfloat16, seed=17))
    b.query = b.query * 4  # scores large enough for a cap to bite
    fail_on_loops(monkeypatch)
    fail_on(monkeypatch, ref, "paged_attention", "attend_long_pieces")
    serial, parallel = serial_and_parallel(b, window=window, soft_cap=soft_cap)
    want = dense_attention(b, window, soft_cap).to(torch.bfloat16).double()
    for got in (serial, parallel):
        torch.testing.assert_close(got.double(), want, **BF16_STEP)


@tiles
def test_bf16_tiles_read_no_block_before_a_window():
    """The blocks wholly before a row's window may have been handed on: poisoned,
    they change nothing; the slots of the window's first block before it are
    scored by the tile and left out."""
    window, block_size = 21, 16
    b = on_cpu(make_batch(LONG_DECODES, 8, 2, 64, block_size, torch.bfloat16, seed=18))
    want = cpu_attention.paged_attention(*b.args(), window=window)
    poison = max(set(range(b.k_cache.shape[0])) - set(b.block_tables.flatten().tolist()))
    b.k_cache[poison] = float("nan")
    b.v_cache[poison] = float("nan")
    for s, n in enumerate(b.seq_lens.tolist()):
        b.block_tables[s, : max(0, n - window) // block_size] = poison
    got = cpu_attention.paged_attention(*b.args(), max_seq_len=int(b.seq_lens.max()),
                                        window=window)  # fmt: skip
    assert torch.equal(got, want)
    torch.testing.assert_close(
        got.double(), dense_attention(b, window, None).to(torch.bfloat16).double(), **BF16_STEP
    )
