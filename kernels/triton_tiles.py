"""Triton building blocks shared by the prefill and decode attention kernels.

Tile layout (both kernels): the ``GROUP = num_heads / num_kv_heads`` query
heads that share a KV head are packed into the rows of one tile, so each K/V
tile read from the cache serves the whole group::

    tile row m  ->  query row  m // GROUP  of the program's block,
                    query head kv_head * GROUP + m % GROUP
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise go through TF32 tensor cores (~1e-3 error).
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def find_seq_of_block(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    # Largest s with query_start_loc[s] // BLOCK_Q + s <= q_block. The key is
    # strictly increasing in s (even across empty sequences), so this is exact.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def find_seq_of_token(query_start_loc_ptr, token, num_seqs):
    # Largest s with query_start_loc[s] <= token: the sequence owning the row
    # (an empty sequence shares its start with the next one, which wins).
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


LOG2E = tl.constexpr(1.4426950408889634)  # jit functions read only constexpr globals


@triton.jit
def tanh(x):
    # tanh from one exponential of a non-positive argument: no overflow, and the
    # interpreter runs it too (libdevice's does not).
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def window_start(pos, window, BLOCK_N: tl.constexpr):
    # The first KV position a query at ``pos`` reads under a sliding window,
    # rounded down to a whole tile: tiles start on multiples of BLOCK_N.
    return tl.maximum(pos - window + 1, 0) // BLOCK_N * BLOCK_N


@triton.jit
def attend_kv_range(
    acc,  # [BLOCK_M, BLOCK_D] fp32 running numerator @ V
    m_i,  # [BLOCK_M] fp32 running row max (base-2 logits)
    l_i,  # [BLOCK_M] fp32 running softmax denominator
    q,  # [BLOCK_M, BLOCK_D] query tile
    q_pos,  # [BLOCK_M] absolute position of each row; it sees positions 0..q_pos
    # (q_pos - window + 1..q_pos with USE_WINDOW)
    kv_lo,  # first KV position, a multiple of BLOCK_N
    kv_hi,  # exclusive end of the KV positions read
    bt_row,  # this sequence's block table row
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (read only with USE_WINDOW)
    offs_d,
    d_ok,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,  # 0.0: scores uncapped; else cap * tanh(score / cap)
):
    # Streams K/V positions [kv_lo, kv_hi) through the block table with an
    # online softmax. Tiles need not line up with cache blocks: the lookup is
    # per position, so a range may start or end mid-block. With a window, no
    # position before every row's window is loaded: its block may belong to
    # another sequence by now, and 0 * what it holds need not be 0.
    kv_seen = 0
    if USE_WINDOW:
        kv_seen = tl.min(q_pos, axis=0) - window + 1
    for start_n in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] kv positions
        n_ok = (offs_n < kv_hi) & (offs_n >= kv_seen)
        # position p lives in cache block block_tables[seq, p // BLOCK_SIZE] at slot p % BLOCK_SIZE
        phys = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_off = phys * stride_kb + in_block * stride_ks + kv_head * stride_kh  # [BLOCK_N] int64
        v_off = phys * stride_vb + in_block * stride_vs + kv_head * stride_vh
        k = tl.load(
            k_cache_ptr + k_off[None, :] + offs_d[:, None],
            mask=d_ok[:, None] & n_ok[None, :],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFT_CAP > 0.0:  # capped in natural units, then back to base 2
            s = SOFT_CAP * tanh(s / (SOFT_CAP * LOG2E)) * LOG2E
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that sees nothing yet keeps a finite max so exp2 below yields 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_safe)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
