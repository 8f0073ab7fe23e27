"""The paged KV cache: per-layer K and V block pools, plus one scratch block.

Block ``num_blocks`` (one past the last block the scheduler may hand out) is
scratch: padding rows write their K/V there and read it back, so padding costs
what a real token costs without touching any sequence's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V (per rank's kv heads)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def blocks_for_budget(
    budget_bytes: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> int:
    """How many schedulable blocks fit ``budget_bytes`` (the scratch block included)."""
    per_block = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
    return max(0, budget_bytes // per_block - 1)


@dataclass
class KVCache:
    """K and V pools, each ``num_layers`` tensors of
    ``[num_blocks + 1, block_size, num_kv_heads, head_dim]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    num_blocks: int
    block_size: int

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> KVCache:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}"
            )
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: a kernel that reads a never-written slot must see
        # finite values, or a NaN could leak through 0 * NaN in a softmax.
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys=keys, values=values, num_blocks=num_blocks, block_size=block_size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
