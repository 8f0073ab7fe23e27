"""Which paged attention kernels a batch launches, decided on the host from shapes.

Two Triton kernels share the work of one call (see :mod:`.triton_attention` and
:mod:`.triton_decode`):

- the **decode kernel** takes every sequence with at most ``decode_block_q``
  query rows. Its programs are (sequence, KV head, KV split): with few
  sequences a KV head's cache is cut into ``num_splits`` ranges read in
  parallel (flash-decoding), and a reduce kernel merges the partial softmaxes.
  Its tile is small (16 rows), so a decode row costs little padding;
- the **prefill kernel** takes the longer pieces in ``prefill_block_m``-row
  tiles, one program per (query block, KV head).

Everything here is a function of the call's shapes plus two optional host-side
hints (the longest query piece and the longest sequence), never of tensor
values, so choosing costs no device synchronisation and a CUDA graph captured
for a batch shape replays the same choice. Pure Python: no torch, no triton.

A batch-invariant engine (``invariant``) must attend each row as it would alone,
whatever shares the step, so nothing may follow the batch: not the kernel (a
token decoded as one row and recomputed in a prefill piece after a preemption
must meet the same code), nor the split count (:func:`choose_num_splits` follows
the number of sequences, and a row's splits are merged in another order). Every
row then runs the prefill kernel with the decode kernel's small tile (each row of
a tile computed on its own: its positions in tiles of ``prefill_block_n`` from
the first, tiles past it masked, which leaves its sums unchanged) and one split
for every sequence length. A split at fixed lengths (a function of each row's
own length) would keep flash-decoding's parallelism for a few long sequences,
but a prefill piece's rows would then need partial results per split, ``tokens x
splits x head_dim`` floats a head, and one merge order for both kinds of row;
that is left for a measured need.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# H200 / H100 SXM. Used where the device cannot be asked (the CPU interpreter,
# compile checks); on CUDA the caller passes the real count.
DEFAULT_NUM_SMS = 132
# A split reads at least this many KV positions: below it the reduce and the
# partial results cost more than the extra parallelism returns.
MIN_SPLIT_LEN = 256
MAX_SPLITS = 64
# Enough (sequence, KV head) programs per SM to keep memory busy without splitting.
PROGRAMS_PER_SM_NO_SPLIT = 2
# When splitting, aim for this many programs per SM.
PROGRAMS_PER_SM_SPLIT = 4
DECODE_BLOCK_M = 16


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and warps of both kernels for one (dtype, head_dim, group).

    Chosen so that no variant spills registers on sm_90 (the compile check in
    tests/kernels asserts it): 16-bit K/V tiles of 16 KB whatever the head
    size; fp32 dots run on FMA units and hold every operand in registers, so
    they get smaller prefill tiles and twice the warps in the decode kernel."""

    decode_block_m: int  # decode tile rows = decode_block_q * group (+ padding)
    decode_block_q: int  # the longest query piece the decode kernel takes
    decode_block_n: int  # KV positions per decode tile
    decode_num_warps: int
    prefill_block_m: int
    prefill_block_n: int


def tiles_for(elem_bytes: int, head_dim: int, group: int) -> Tiles:
    block_m, block_q = decode_tile(group)
    padded = next_power_of_2(max(head_dim, 16))
    decode_n = max(16, min(128, 8192 // padded))
    if elem_bytes >= 4:
        # 256-wide fp32 heads (Gemma) hold a quarter as many rows in registers.
        rows = 32 if padded <= 128 else 16
        return Tiles(block_m, block_q, min(decode_n, 64), 8,
                     max(rows, next_power_of_2(group)), rows)  # fmt: skip
    prefill_n = 64 if padded <= 128 else 32
    return Tiles(block_m, block_q, decode_n, 4, max(64, next_power_of_2(group)), prefill_n)


@dataclass(frozen=True)
class AttentionPlan:
    """The launches of one paged attention call."""

    tiles: Tiles
    num_splits: int  # KV ranges per (sequence, KV head) in the decode kernel; 1 = no reduce
    use_decode: bool
    use_prefill: bool


def decode_tile(group: int) -> tuple[int, int]:
    """(block_m, block_q) of the decode kernel: the query heads of one KV head
    fill the tile's rows, ``block_q`` query rows of ``group`` heads each."""
    block_m = max(DECODE_BLOCK_M, next_power_of_2(group))
    return block_m, block_m // group


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = DEFAULT_NUM_SMS
) -> int:
    """KV splits per (sequence, KV head) so that the decode kernel fills the GPU.

    A batch of 64 sequences with 8 KV heads already has 512 programs and is not
    split; one sequence at 8k context is split 32 ways (256 programs)."""
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= PROGRAMS_PER_SM_NO_SPLIT * num_sms:
        return 1
    wanted = -(-PROGRAMS_PER_SM_SPLIT * num_sms // programs)
    longest = -(-max(1, max_seq_len) // MIN_SPLIT_LEN)
    return max(1, min(wanted, longest, MAX_SPLITS))


def plan_attention(
    *,
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    max_query_len: int | None = None,
    elem_bytes: int = 2,
    num_sms: int = DEFAULT_NUM_SMS,
    window: int | None = None,
    invariant: bool = False,
) -> AttentionPlan:
    """The launches for a call with these shapes.

    ``max_seq_len`` bounds every sequence's KV length (the block table's width
    times the block size does). ``max_query_len`` is the longest query piece
    when the caller knows it; otherwise ``num_tokens`` bounds it. A wrong
    (too small) hint leaves rows uncomputed: hints are trusted, like the
    metadata itself. With a sliding ``window`` a decode row reads at most about
    ``window`` positions, whatever its sequence's length: that is what is split.
    ``invariant``: a batch-invariant engine's plan, the same for every call (the
    module's docstring).
    """
    tiles = tiles_for(elem_bytes, head_dim, num_heads // num_kv_heads)
    if invariant:
        tiles = dataclasses.replace(tiles, prefill_block_m=tiles.decode_block_m)
        return AttentionPlan(tiles=tiles, num_splits=1, use_decode=False, use_prefill=True)
    if window is not None:
        max_seq_len = min(max_seq_len, window + tiles.decode_block_q + tiles.decode_block_n)
    longest_piece = num_tokens if max_query_len is None else min(max_query_len, num_tokens)
    use_prefill = longest_piece > tiles.decode_block_q
    # With one sequence its piece is num_tokens rows exactly: all decode or all prefill.
    use_decode = not (use_prefill and num_seqs == 1)
    num_splits = (
        choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms) if use_decode else 1
    )
    return AttentionPlan(
        tiles=tiles, num_splits=num_splits, use_decode=use_decode, use_prefill=use_prefill
    )
