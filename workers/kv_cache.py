"""The paged KV cache: per-layer K and V block pools, plus one scratch block.

Block ``num_blocks`` (one past the last block the scheduler may hand out) is
scratch: padding rows write their K/V there and read it back, so padding costs
what a real token costs without touching any sequence's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.cpu.memory import tensor_on_huge_pages


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


# Slot ids (block_id * block_size + offset) travel as int32.
MAX_SLOTS = 2**31 - 1
# cuBLAS workspaces, CUDA graph pools and the allocator's slack, on top of the
# activations ``workspace_bytes`` counts.
RUNTIME_RESERVE_BYTES = 1 << 30


def workspace_bytes(
    *,
    hidden_size: int,
    intermediate_size: int,
    q_size: int,
    kv_size: int,
    vocab_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype: torch.dtype,
) -> int:
    """Activation memory of the largest step, estimated from the model's shapes:
    per token the fused QKV and gate/up outputs plus a few hidden-sized
    tensors, per sampled row its fp32 logits a few times over (the sampler's
    copies), and ``RUNTIME_RESERVE_BYTES``."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = (q_size + 2 * kv_size + 3 * intermediate_size + 6 * hidden_size) * elem
    per_row = 4 * vocab_size * 4
    return max_num_batched_tokens * per_token + max_num_seqs * per_row + RUNTIME_RESERVE_BYTES


def kv_budget_bytes(free_bytes: int, weight_bytes: int, workspace: int, fraction: float) -> int:
    """Bytes for the KV cache: ``fraction`` of the free memory, but never more than
    is left once the weights and the step's workspace are placed (free memory is
    measured before the weights load, so without this a large fraction runs out)."""
    return max(0, min(int(free_bytes * fraction), free_bytes - weight_bytes - workspace))


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
        if (num_blocks + 1) * block_size > MAX_SLOTS:
            raise ValueError(
                f"{num_blocks} blocks of {block_size} tokens exceed the {MAX_SLOTS} slots "
                "that int32 slot ids address"
            )
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        keys = [_zeroed(shape, dtype, device) for _ in range(num_layers)]
        values = [_zeroed(shape, dtype, device) for _ in range(num_layers)]
        return cls(keys=keys, values=values, num_blocks=num_blocks, block_size=block_size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed cache tensor. Zeroed, not empty: a kernel that reads a never-written
    slot must see finite values, or a NaN could leak through 0 * NaN in a softmax.
    On the host it is backed by huge pages where the kernel grants them, asked for
    before the zeroing touches it: a decode step reads its sequences' blocks from
    all over the cache, and with 4 KiB pages every block costs TLB misses."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    tensor_on_huge_pages(tensor)
    return tensor.zero_()
