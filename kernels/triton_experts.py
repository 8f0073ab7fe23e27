"""The experts of a mixture-of-experts layer as grouped Triton matrix products.

Same contract as :func:`iterserve.kernels.experts.fused_experts`. The step's
``(token, k)`` pairs are sorted by expert on the device and each expert's run
is padded to whole ``BLOCK_M``-row blocks, so every block of rows belongs to
one expert (as vLLM's ``moe_align_block_size`` lays them out)::

    pairs by expert   e0: p3 p7 | e2: p0 p1 p4 p5 p9 | e5: p2
    BLOCK_M = 4       [p3 p7 -- --][p0 p1 p4 p5][p9 -- -- --][p2 -- -- --] ...
    block_expert      [  0        ][  2        ][  2        ][  5        ] E E E

Then two launches cover every expert of the layer: gate/up with the gated
activation (``[pairs, inter]``), and down scaled by each pair's routing weight
(``[pairs, hidden]``), summed over a token's ``top_k`` pairs. A program reads
only its expert's weights; experts no token chose cost a program that exits.
Nothing here waits on the device (no host sync), so a CUDA graph can capture it:
the padded length is bounded from shapes (``pairs + min(experts, pairs) *
(BLOCK_M - 1)``) and blocks past the real ones exit at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import checks
from .experts import check_fused_experts
from .triton_ops import device_guard
from .triton_tiles import dot_precision, tanh


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_expert)``: pair indices (``token * top_k + k``) grouped
    by expert in ``block_m``-row blocks, padding slots holding ``num_pairs``; and
    each block's expert, ``num_experts`` for a block past the real ones."""
    flat = topk_ids.reshape(-1).long()  # [num_pairs]
    num_pairs, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[expert_of]
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    bound = -(-bound // block_m) * block_m
    sorted_pairs = torch.full((bound,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[(padded_end - padded)[expert_of] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, bound, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _block_rows(block_expert_ptr, sorted_pairs_ptr, num_pairs, BLOCK_M: tl.constexpr):
    # This program's block of rows: its expert, and the (token, k) pair of each row
    # (num_pairs for the padding that completes an expert's last block).
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, pair, pair < num_pairs


@triton.jit
def _gate_up_kernel(
    out_ptr,  # [num_pairs, inter]: act(gate) * up of each pair
    x_ptr,  # [num_tokens, hidden]
    w13_ptr,  # [num_experts, 2 * inter, hidden]
    sorted_pairs_ptr,  # [bound]
    block_expert_ptr,  # [bound // BLOCK_M]
    num_pairs,
    stride_xt,
    stride_we,
    stride_wn,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GELU: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    expert, pair, row_ok = _block_rows(block_expert_ptr, sorted_pairs_ptr, num_pairs, BLOCK_M)
    if expert >= NUM_EXPERTS:
        return  # past the real blocks
    token = pair // TOP_K  # [BLOCK_M]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < HIDDEN
        a = tl.load(x_ptr + token[:, None] * stride_xt + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_gate = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask,
                         other=0.0)  # [BLOCK_K, BLOCK_N]  # fmt: skip
        w_up = tl.load(w_base + (INTER + offs_n)[None, :] * stride_wn + offs_k[:, None],
                       mask=w_mask, other=0.0)  # fmt: skip
        gate += tl.dot(a, w_gate, input_precision=DOT_PRECISION)
        up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
    if GELU:
        act = 0.5 * gate * (1.0 + tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + pair[:, None] * INTER + offs_n[None, :],
             (act * up).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit
def _down_kernel(
    h_ptr,  # [num_pairs, inter]
    w2_ptr,  # [num_experts, hidden, inter]
    out_ptr,  # [num_pairs, hidden] fp32: each pair's expert output times its weight
    weights_ptr,  # [num_pairs] routing weights
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    stride_we,
    stride_wn,
    NUM_EXPERTS: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    expert, pair, row_ok = _block_rows(block_expert_ptr, sorted_pairs_ptr, num_pairs, BLOCK_M)
    if expert >= NUM_EXPERTS:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < HIDDEN
    w_base = w2_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < INTER
        a = tl.load(h_ptr + pair[:, None] * INTER + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    scale = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + pair[:, None] * HIDDEN + offs_n[None, :], acc * scale[:, None],
             mask=row_ok[:, None] & n_ok[None, :])  # fmt: skip


def block_m_for(num_pairs: int) -> int:
    """Rows per block: small steps (decodes) pad each expert's run to little."""
    return 16 if num_pairs <= 256 else 64


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str = "silu",
    packed: Sequence | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """:func:`iterserve.kernels.experts.fused_experts` in two grouped launches.
    ``packed`` (the CPU's packed weights) is not used here. ``invariant``: a
    batch-invariant engine's, whose blocks have 16 rows whatever the step's size
    and whose token's experts are added one after the other in their order."""
    check_fused_experts(x, w13, w2, topk_ids, topk_weights, activation)
    checks.check_triton_device("x", x)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = 16 if invariant else block_m_for(num_pairs)
    block_k = 32 if x.element_size() >= 4 else 64
    precision = dot_precision(x.dtype)
    with device_guard(x):
        sorted_pairs, block_expert = align_by_expert(topk_ids, num_experts, block_m)
        num_blocks = block_expert.shape[0]
        h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
        block_n = min(64, max(16, triton.next_power_of_2(inter)))
        _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
            h, x, w13, sorted_pairs, block_expert, num_pairs,
            x.stride(0), w13.stride(0), w13.stride(1),
            NUM_EXPERTS=num_experts, TOP_K=top_k, HIDDEN=hidden, INTER=inter,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            GELU=activation == "gelu_tanh", DOT_PRECISION=precision,
        )  # fmt: skip
        out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
        block_n = min(64, max(16, triton.next_power_of_2(hidden)))
        weights = topk_weights.reshape(-1).contiguous()
        _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
            h, w2, out, weights, sorted_pairs, block_expert, num_pairs,
            w2.stride(0), w2.stride(1),
            NUM_EXPERTS=num_experts, HIDDEN=hidden, INTER=inter,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
        )  # fmt: skip
    out = out.view(num_tokens, top_k, hidden)
    if invariant:  # torch's reduction over dim 1 may block its sums by the tensor's size
        total = out[:, 0].clone()
        for k in range(1, top_k):
            total += out[:, k]
        return total.to(x.dtype)
    return out.sum(dim=1).to(x.dtype)
