"""KV cache sizing and layout."""

from __future__ import annotations

import torch

from iterserve.workers.kv_cache import KVCache, blocks_for_budget, bytes_per_block


def test_allocate_adds_a_scratch_block():
    kv = KVCache.allocate(3, 10, 4, 2, 8, torch.float16, "cpu")
    assert len(kv.keys) == len(kv.values) == 3
    assert kv.keys[0].shape == (11, 4, 2, 8) and kv.keys[0].dtype == torch.float16
    assert kv.scratch_block == 10
    assert kv.nbytes == 11 * bytes_per_block(3, 4, 2, 8, torch.float16)


def test_blocks_for_budget_leaves_room_for_scratch():
    per_block = bytes_per_block(2, 16, 4, 64, torch.float32)
    assert per_block == 2 * 2 * 16 * 4 * 64 * 4
    assert blocks_for_budget(per_block * 101, 2, 16, 4, 64, torch.float32) == 100
    assert blocks_for_budget(per_block * 101 - 1, 2, 16, 4, 64, torch.float32) == 99
    assert blocks_for_budget(0, 2, 16, 4, 64, torch.float32) == 0
