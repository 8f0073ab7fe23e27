"""Triton kernel writing this step's keys and values into the paged KV cache.

Same signature and argument checks as :func:`iterserve.kernels.reference.store_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import checks
from .triton_ops import device_guard


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache_ptr,  # same layout as k_cache
    slot_mapping_ptr,  # [num_tokens]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program copies all heads of one token.
    #
    # The caches are contiguous, so a flat slot (block_id * block_size + offset)
    # addresses one [num_kv_heads, head_dim] row of the cache viewed as
    # [num_blocks * block_size, num_kv_heads, head_dim]:
    #
    #   slot:      0   1  ... bs-1 | bs  bs+1 ...      (block 0 | block 1 | ...)
    #   address:   slot * num_kv_heads * head_dim + head * head_dim + d
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # negative slots mark padding rows: nothing is stored for them
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src_k = token.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(key_ptr + src_k, mask=mask)  # [BLOCK_H, BLOCK_D]
    v = tl.load(value_ptr + src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V into its cache slot; negative slots are skipped."""
    checks.check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    checks.check_triton_device("key", key)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    with device_guard(key):
        _store_kv_kernel[(num_tokens,)](
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
