"""Triton paged attention for a flattened mixed batch of decode rows and prefill pieces.

Work split
----------
The query rows of all sequences are cut into *query blocks* of ``BLOCK_Q``
rows; every block belongs to exactly one sequence. A program handles one
query block for one KV head, and packs the ``GROUP = num_heads / num_kv_heads``
query heads that share that KV head into the rows of its tile, so each K/V
tile read from the cache serves the whole group (this is what makes decode
with grouped-query attention cheap)::

    tile row m  ->  query row  m // GROUP  of the block,  query head  kv_head * GROUP + m % GROUP
    BLOCK_M = BLOCK_Q * GROUP (+ padding rows when GROUP does not divide BLOCK_M)

Sequence ``s`` owns the global query blocks starting at
``query_start_loc[s] // BLOCK_Q + s`` (the ``+ s`` leaves room for a partial
block at the start of every sequence), so the grid size
``num_tokens // BLOCK_Q + num_seqs`` is an upper bound known from shapes alone,
and a program finds its sequence by binary search; no host synchronisation
is needed. Programs past the end of their sequence exit at once.

Each program then streams the sequence's K/V in tiles of ``BLOCK_N``
positions through the block table, with an online (streaming) softmax in
fp32, stopping at the last position any of its rows can see.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import checks
from .triton_ops import device_guard


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
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
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim], contiguous
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    scale,
    num_seqs,
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
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens per block)
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_M: tl.constexpr,  # tile rows = BLOCK_Q * GROUP (+ padding)
    BLOCK_Q: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # kv positions per tile
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_seq_idx(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return  # spare program (also every program of a sequence with q_len == 0)

    seq_len = tl.load(seq_lens_ptr + seq)
    # This step's rows are the last q_len positions of the sequence:
    #
    #   kv positions:  0 ........ context_len-1 | context_len ... seq_len-1
    #                  cached prefix            | this step's rows (already stored)
    #
    # Row i sits at context_len + i and sees positions 0..context_len + i. The
    # prefix may end mid-block; the block table lookup below is per position,
    # so tiles need not line up with cache blocks.
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = local_block * BLOCK_Q + offs_m // GROUP  # query row within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    q_pos = context_len + q_idx  # [BLOCK_M] absolute position of each row

    # Exclusive end of the kv range: one past the position of this block's last row.
    kv_end = context_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (base-2 logits)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running numerator @ V
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] kv positions
        n_ok = offs_n < kv_end
        # position p lives in cache block block_tables[seq, p // BLOCK_SIZE] at slot p % BLOCK_SIZE
        phys = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_off = phys * stride_kb + in_block * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        v_off = phys * stride_vb + in_block * stride_vs + kv_head * stride_vh
        k = tl.load(
            k_cache_ptr + k_off[None, :] + offs_d[:, None],
            mask=d_ok[:, None] & n_ok[None, :],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that sees nothing yet keeps a finite max so exp2 below yields 0, not NaN.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def default_tiles(num_tokens: int, num_seqs: int, group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) from shapes only: small tiles for decode-heavy batches."""
    decode_heavy = num_tokens <= 2 * num_seqs
    block_m = max(16 if decode_heavy else 64, triton.next_power_of_2(group))
    block_n = 64 if head_dim <= 128 else 32
    return block_m, block_n


def paged_attention_launch(
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
) -> torch.Tensor:
    """Launch with explicit tile sizes (arguments already checked)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if block_m < max(16, group) or block_n < 16:
        raise ValueError(f"tile sizes too small: block_m={block_m}, block_n={block_n}")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    with device_guard(query):
        _paged_attention_kernel[grid](
            out,
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            float(scale),
            num_seqs,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_tables.stride(0),
            HEAD_DIM=head_dim,
            BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
            BLOCK_SIZE=block_size,
            GROUP=group,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=block_n,
            # fp32 inputs would otherwise go through TF32 tensor cores (~1e-3 error).
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            num_warps=4,
        )
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a flattened mixed batch over a paged KV cache.

    Same contract as :func:`iterserve.kernels.reference.paged_attention`;
    the metadata values are trusted (checking them would need a GPU sync).
    """
    checks.check_paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
    )
    checks.check_triton_device("query", query)
    num_tokens, num_heads, head_dim = query.shape
    group = num_heads // k_cache.shape[2]
    block_m, block_n = default_tiles(num_tokens, seq_lens.shape[0], group, head_dim)
    return paged_attention_launch(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        block_m=block_m,
        block_n=block_n,
    )
