"""Split-KV (flash-decoding) paged attention for sequences with few query rows.

One program per (sequence, KV head, KV split). A sequence of ``seq_len``
positions is cut into ``num_splits`` ranges of ``split_len`` positions, a
multiple of the tile width, computed on the device from ``seq_len`` itself::

    split_len = cdiv(cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N

    positions  0 ........ split_len | ........ 2*split_len | ... | seq_len
    split      0                    | 1                    | ... (the rest exit)

so one launch shape serves every context length up to the block table's width
(what a CUDA graph needs), and a short sequence simply leaves its later splits
idle. With a sliding window the splits cut the positions the rows read,
``[window_start, seq_len)``, not the whole sequence. Each split writes its unnormalised partial output with its running max
and denominator; the reduce kernel merges them. With ``num_splits == 1`` the
decode kernel normalises and writes the output itself.

A sequence with more than ``BLOCK_Q`` query rows is left to the prefill kernel
(:mod:`.triton_attention`); one with ``BLOCK_Q`` rows or fewer fits one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_tiles import LOG2E, attend_kv_range, dot_precision, find_seq_of_token, window_start


@triton.jit
def _split_range(seq_len, q_len, num_splits, window, BLOCK_N: tl.constexpr,
                 USE_WINDOW: tl.constexpr):  # fmt: skip
    # Where the splits start and how long each is, shared by the kernel and its reduce.
    kv_start = 0
    if USE_WINDOW:  # the first row's window; later rows read less of it
        kv_start = window_start(seq_len - q_len, window, BLOCK_N)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, num_splits), BLOCK_N) * BLOCK_N
    return kv_start, split_len


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "window"])
def _paged_decode_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim], contiguous
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, HEAD_DIM] fp32 (SPLIT only)
    part_ml_ptr,  # [num_tokens, num_heads, num_splits, 2] fp32: running max (base 2), sum
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    scale,
    window,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,  # tile rows = BLOCK_Q * GROUP (+ padding)
    BLOCK_Q: tl.constexpr,  # the most query rows a sequence may have here
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # write partials for the reduce instead of the output
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if (q_len == 0) | (q_len > BLOCK_Q):
        return  # nothing to compute, or a piece the prefill kernel takes
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start, split_len = _split_range(seq_len, q_len, num_splits, window, BLOCK_N, USE_WINDOW)
    kv_lo = kv_start + split * split_len
    if kv_lo >= seq_len:
        return  # a short sequence: its later splits have nothing to read
    kv_hi = tl.minimum(kv_lo + split_len, seq_len)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = offs_m // GROUP  # query row within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = q_idx < q_len
    d_ok = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    q_pos = seq_len - q_len + q_idx  # [BLOCK_M] the last q_len positions are this step's rows
    qk_scale = scale * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q, q_pos, kv_lo, kv_hi, bt_row, k_cache_ptr, v_cache_ptr, kv_head,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale, window,
        offs_d, d_ok, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, USE_WINDOW, SOFT_CAP,
    )  # fmt: skip

    if SPLIT:
        # Row r of a piece sees no position of a split that starts past it: its
        # max stays -inf and its sum 0, which the reduce weighs as nothing.
        part = (token * num_heads + head) * num_splits + split  # [BLOCK_M] int64
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "window"])
def _split_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, HEAD_DIM] fp32
    part_ml_ptr,  # [num_tokens, num_heads, num_splits, 2] fp32
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    num_splits,
    window,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    # One program merges the splits of one (query row, head):
    #   out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s
    token = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    seq = find_seq_of_token(query_start_loc_ptr, token, num_seqs)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - tl.load(query_start_loc_ptr + seq)
    if q_len > BLOCK_Q:
        return  # the prefill kernel wrote this row
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start, split_len = _split_range(seq_len, q_len, num_splits, window, BLOCK_N, USE_WINDOW)
    num_active = tl.cdiv(seq_len - kv_start, split_len)

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    base = (token.to(tl.int64) * num_heads + head) * num_splits
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, num_active):
        m_s = tl.load(part_ml_ptr + (base + s) * 2 + tl.zeros([1], tl.int32))
        l_s = tl.load(part_ml_ptr + (base + s) * 2 + 1 + tl.zeros([1], tl.int32))
        a_s = tl.load(part_acc_ptr + (base + s) * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        m_new = tl.maximum(m_run, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        beta = tl.exp2(m_s - m_safe)
        l_run = l_run * alpha + l_s * beta
        acc = acc * alpha + a_s * beta
        m_run = m_new
    # Some split holds the row's own position, which it always sees: l_run > 0.
    out = acc / l_run
    tl.store(
        out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def launch_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    block_m: int,
    block_n: int,
    num_splits: int,
    num_warps: int = 4,
    window: int | None = None,
    soft_cap: float | None = None,
) -> None:
    """The decode kernel (and its reduce when ``num_splits > 1``) over every
    sequence with at most ``block_m // group`` query rows."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if block_m < max(16, group) or block_n < 16 or num_splits < 1:
        raise ValueError(
            f"bad decode launch: block_m={block_m}, block_n={block_n}, num_splits={num_splits}"
        )
    num_seqs = seq_lens.shape[0]
    block_q = block_m // group
    block_d = max(triton.next_power_of_2(head_dim), 16)
    split = num_splits > 1
    if split:
        part_acc = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=out.device
        )
        part_ml = torch.empty(
            (num_tokens, num_heads, num_splits, 2), dtype=torch.float32, device=out.device
        )
    else:
        part_acc = part_ml = out  # never touched without SPLIT
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_acc, part_ml, query, k_cache, v_cache, block_tables, seq_lens,
        query_start_loc, float(scale), window or 0, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_PRECISION=dot_precision(query.dtype),
        USE_WINDOW=window is not None,
        SOFT_CAP=float(soft_cap or 0.0),
        num_warps=num_warps,
    )  # fmt: skip
    if split:
        _split_reduce_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, seq_lens, query_start_loc, num_seqs, num_splits, window or 0,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_Q=block_q,
            BLOCK_N=block_n,
            USE_WINDOW=window is not None,
            num_warps=1 if block_d <= 128 else 2,
        )  # fmt: skip
