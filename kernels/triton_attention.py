"""Triton paged attention for a flattened mixed batch of decode rows and prefill pieces.

One call launches up to three kernels, chosen on the host by
:func:`~iterserve.kernels.attention_plan.plan_attention` from shapes alone:
the split-KV decode kernel and its reduce (:mod:`.triton_decode`) for the
sequences with few query rows, and the prefill kernel below for the longer
pieces. Each sequence's rows are written by exactly one of them.

Prefill kernel work split
-------------------------
The query rows of all sequences are cut into *query blocks* of ``BLOCK_Q``
rows; every block belongs to exactly one sequence. A program handles one
query block for one KV head, with the ``GROUP`` query heads of that KV head
packed into the rows of its tile (:mod:`.triton_tiles`)::

    BLOCK_M = BLOCK_Q * GROUP (+ padding rows when GROUP does not divide BLOCK_M)

Sequence ``s`` owns the global query blocks starting at
``query_start_loc[s] // BLOCK_Q + s`` (the ``+ s`` leaves room for a partial
block at the start of every sequence), so the grid size
``num_tokens // BLOCK_Q + num_seqs`` is an upper bound known from shapes alone,
and a program finds its sequence by binary search; no host synchronisation
is needed. Programs past the end of their sequence, and those of sequences the
decode kernel serves (``q_len <= skip_q_len``), exit at once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import checks
from .attention_plan import DEFAULT_NUM_SMS, AttentionPlan, plan_attention
from .triton_decode import launch_decode
from .triton_ops import device_guard
from .triton_tiles import LOG2E, attend_kv_range, dot_precision, find_seq_of_block, window_start


# Per-step values are not specialised on: a new batch size or block-table width
# must not compile a new variant in the middle of serving.
@triton.jit(do_not_specialize=["num_seqs", "skip_q_len", "stride_bt", "window"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim], contiguous
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    scale,
    window,  # sliding window (read only with USE_WINDOW)
    num_seqs,
    skip_q_len,  # sequences with at most this many rows belong to the decode kernel
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
    USE_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = find_seq_of_block(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if (local_block * BLOCK_Q >= q_len) | (q_len <= skip_q_len):
        return  # spare program (also every program of a sequence with q_len == 0)

    seq_len = tl.load(seq_lens_ptr + seq)
    # This step's rows are the last q_len positions of the sequence:
    #
    #   kv positions:  0 ........ context_len-1 | context_len ... seq_len-1
    #                  cached prefix            | this step's rows (already stored)
    #
    # Row i sits at context_len + i and sees positions 0..context_len + i. The
    # prefix may end mid-block.
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
    kv_begin = 0
    if USE_WINDOW:  # nothing before the window of this block's first row
        kv_begin = window_start(context_len + local_block * BLOCK_Q, window, BLOCK_N)
    qk_scale = scale * LOG2E  # softmax in base 2: exp(x) = exp2(x * log2(e))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q, q_pos, kv_begin, kv_end, bt_row, k_cache_ptr, v_cache_ptr, kv_head,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale, window,
        offs_d, d_ok, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, USE_WINDOW, SOFT_CAP,
    )  # fmt: skip

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def launch_prefill(
    out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
    *, block_m: int, block_n: int, skip_q_len: int = 0, num_warps: int = 4,
    window: int | None = None, soft_cap: float | None = None,
) -> None:  # fmt: skip
    """The prefill kernel over every sequence with more than ``skip_q_len`` rows."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        float(scale), window or 0, num_seqs, skip_q_len,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype),
        USE_WINDOW=window is not None,
        SOFT_CAP=float(soft_cap or 0.0),
        num_warps=num_warps,
    )  # fmt: skip


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
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Every sequence through the prefill kernel with explicit tile sizes
    (arguments already checked)."""
    group = query.shape[1] // k_cache.shape[2]
    if block_m < max(16, group) or block_n < 16:
        raise ValueError(f"tile sizes too small: block_m={block_m}, block_n={block_n}")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    with device_guard(query):
        launch_prefill(
            out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
            block_m=block_m, block_n=block_n, window=window, soft_cap=soft_cap,
        )  # fmt: skip
    return out


def run_plan(
    plan: AttentionPlan,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """The launches of ``plan`` (arguments already checked)."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    args = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    masks = {"window": window, "soft_cap": soft_cap}
    t = plan.tiles
    with device_guard(query):
        if plan.use_decode:
            launch_decode(
                out, *args, block_m=t.decode_block_m, block_n=t.decode_block_n,
                num_splits=plan.num_splits, num_warps=t.decode_num_warps, **masks,
            )  # fmt: skip
        if plan.use_prefill:
            # Without the decode launch every sequence is the prefill kernel's.
            skip = t.decode_block_q if plan.use_decode else 0
            launch_prefill(out, *args, block_m=t.prefill_block_m, block_n=t.prefill_block_n,
                           skip_q_len=skip, **masks)  # fmt: skip
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Causal attention of a flattened mixed batch over a paged KV cache.

    Same contract as :func:`iterserve.kernels.reference.paged_attention`;
    the metadata values are trusted (checking them would need a GPU sync), and
    so are the hints ``max_query_len`` (longest query piece) and
    ``max_seq_len`` (longest sequence), which only steer the choice of kernels.
    ``invariant``: a batch-invariant engine's plan (:mod:`.attention_plan`).
    """
    checks.check_paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window, soft_cap
    )
    checks.check_triton_device("query", query)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    bound = block_tables.shape[1] * block_size
    plan = plan_attention(
        num_tokens=num_tokens,
        num_seqs=seq_lens.shape[0],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_seq_len=bound if max_seq_len is None else min(max_seq_len, bound),
        max_query_len=max_query_len,
        elem_bytes=query.element_size(),
        num_sms=_num_sms(query.device),
        window=window,
        invariant=invariant,
    )
    return run_plan(plan, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    window, soft_cap)  # fmt: skip
