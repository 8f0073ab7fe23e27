"""Triton kernels for the element-wise and per-token serving ops.

``rms_norm``, ``rotary_embedding`` and ``silu_mul``: one program
per token (plus a column split for ``silu_mul``). Each wrapper runs the same
argument checks as the torch reference in :mod:`.reference` and has the same
signature. All arithmetic is fp32; results are stored in the input dtype.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import checks
from .triton_tiles import tanh


def device_guard(t: torch.Tensor):
    """Launch on the tensor's GPU (Triton launches on the current CUDA device)."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------- rms_norm


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_tokens, hidden], contiguous
    residual_out_ptr,  # [num_tokens, hidden], contiguous (unused without residual)
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden] (unused without residual)
    weight_ptr,  # [hidden]
    stride_x,
    stride_r,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    # One program normalises one row; the whole row lives in registers.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # The sum is rounded to the input dtype before normalising, as an
        # un-fused `x + residual` followed by RMSNorm would do.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * HIDDEN + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / HIDDEN
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)  # cast before the weight, like HF
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Llama RMSNorm; with ``residual`` returns ``(norm(x + residual), x + residual)``."""
    checks.check_rms_norm(x, weight, eps, residual)
    checks.check_triton_device("x", x)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    has_residual = residual is not None
    residual_out = torch.empty_like(out) if has_residual else out
    if num_tokens > 0:
        block = triton.next_power_of_2(hidden)
        with device_guard(x):
            _rms_norm_kernel[(num_tokens,)](
                out,
                residual_out,
                x,
                residual if has_residual else x,
                weight,
                x.stride(0),
                residual.stride(0) if has_residual else 0,
                float(eps),
                HIDDEN=hidden,
                BLOCK=block,
                HAS_RESIDUAL=has_residual,
                num_warps=min(max(block // 256, 1), 16),
            )
    if has_residual:
        return out, residual_out
    return out


# --------------------------------------------------------------- rotary_embedding


@triton.jit
def _rotate_heads(
    out_ptr,  # [num_tokens, heads, head_dim], contiguous
    x_ptr,  # [num_tokens, heads, head_dim]
    token,
    stride_t,
    stride_h,
    cos,  # [BLOCK_HALF] fp32
    sin,  # [BLOCK_HALF] fp32
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # rotate_half layout: each head is [x1 | x2] with x1 = x[:HALF], x2 = x[HALF:]
    #   out1 = x1 * cos - x2 * sin
    #   out2 = x2 * cos + x1 * sin
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_j[None, :] < HALF)
    src = token * stride_t + offs_h[:, None] * stride_h + offs_j[None, :]
    dst = token * (NUM_HEADS * 2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_j[None, :]
    x1 = tl.load(x_ptr + src, mask=mask, other=0.0)  # [BLOCK_H, BLOCK_HALF]
    x2 = tl.load(x_ptr + src + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    out1 = x1f * c - x2f * s
    out2 = x2f * c + x1f * s
    tl.store(out_ptr + dst, out1.to(x1.dtype), mask=mask)
    tl.store(out_ptr + dst + HALF, out2.to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_out_ptr,  # [num_tokens, num_heads, head_dim], contiguous
    k_out_ptr,  # [num_tokens, num_kv_heads, head_dim], contiguous
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    positions_ptr,  # [num_tokens]
    cos_sin_ptr,  # [max_position, head_dim], contiguous: [cos | sin]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program rotates every query and key head of one token; the token's
    # cos/sin row is loaded once and shared by all of them.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_HALF)
    jmask = offs_j < HALF
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + offs_j, mask=jmask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + offs_j, mask=jmask, other=0.0)
    sin = sin.to(tl.float32)
    _rotate_heads(
        q_out_ptr,
        q_ptr,
        token,
        stride_qt,
        stride_qh,
        cos,
        sin,
        NUM_HEADS,
        HALF,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_out_ptr,
        k_ptr,
        token,
        stride_kt,
        stride_kh,
        cos,
        sin,
        NUM_KV_HEADS,
        HALF,
        BLOCK_HK,
        BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate_half) rotary embedding; returns new tensors."""
    checks.check_rotary_embedding(positions, query, key, cos_sin_cache)
    checks.check_triton_device("query", query)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    with device_guard(query):
        _rotary_kernel[(num_tokens,)](
            q_out,
            k_out,
            query,
            key,
            positions,
            cos_sin_cache,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HALF=half,
            BLOCK_HQ=triton.next_power_of_2(num_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half),
        )
    return q_out, k_out


# ----------------------------------------------------------------------- silu_mul


@triton.jit
def _act_mul_kernel(
    out_ptr,  # [num_tokens, d], contiguous
    x_ptr,  # [num_tokens, 2 * d]: [gate | up]
    stride_x,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    GELU: tl.constexpr,  # GELU (tanh approximation) instead of SiLU
):
    # Grid: (token, column block). Column j of the output reads x[j] (gate) and x[D + j] (up).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
        y = 0.5 * gate * (1.0 + tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
    else:
        y = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * D + offs, (y * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` computed in fp32, returned in x's dtype."""
    return _act_mul(x, gelu=False)


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(x[:, :d]) * x[:, d:]`` (tanh approximation), fp32 inside."""
    return _act_mul(x, gelu=True)


def _act_mul(x: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    checks.check_silu_mul(x)
    checks.check_triton_device("x", x)
    num_tokens, two_d = x.shape
    d = two_d // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or d == 0:
        return out
    block = min(triton.next_power_of_2(d), 1024)
    with device_guard(x):
        _act_mul_kernel[(num_tokens, triton.cdiv(d, block))](
            out, x, x.stride(0), D=d, BLOCK=block, GELU=gelu
        )
    return out
