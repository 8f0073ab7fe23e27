"""KV cache sizing and layout."""

from __future__ import annotations

import pytest
import torch

from iterserve.workers.kv_cache import (
    RUNTIME_RESERVE_BYTES,
    KVCache,
    blocks_for_budget,
    bytes_per_block,
    kv_budget_bytes,
    workspace_bytes,
)


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


def test_budget_leaves_room_for_the_weights_and_the_workspace():
    gib = 1 << 30
    # A small fraction of free memory is taken as asked...
    assert kv_budget_bytes(140 * gib, 16 * gib, 2 * gib, 0.3) == int(140 * gib * 0.3)
    # ...a large one stops where the weights (loaded after the measurement) begin.
    assert kv_budget_bytes(140 * gib, 16 * gib, 2 * gib, 0.95) == 122 * gib
    assert kv_budget_bytes(10 * gib, 16 * gib, 2 * gib, 0.9) == 0


def test_workspace_grows_with_the_step():
    kw = dict(hidden_size=4096, intermediate_size=14336, q_size=4096, kv_size=1024,
              vocab_size=128256, max_num_seqs=64, dtype=torch.bfloat16)  # fmt: skip
    small = workspace_bytes(max_num_batched_tokens=512, **kw)
    large = workspace_bytes(max_num_batched_tokens=8192, **kw)
    assert RUNTIME_RESERVE_BYTES < small < large < 4 * RUNTIME_RESERVE_BYTES


def test_weight_bytes_match_the_loaded_model(checkpoint_dir):
    from iterserve.workers import ModelRunner
    from iterserve.workers.model import weight_bytes

    for name in ("llama", "qwen2"):
        runner = ModelRunner(checkpoint_dir(name), num_kv_blocks=4, block_size=8,
                             kernel_backend="torch")  # fmt: skip
        loaded = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        assert weight_bytes(runner.config, torch.float32) == loaded
        assert weight_bytes(runner.config, torch.bfloat16) == loaded // 2
        half = weight_bytes(runner.config, torch.float32, tp_rank=1, tp_size=2)
        assert loaded // 2 < half < loaded  # embeddings and norms are replicated


def test_slot_ids_must_fit_int32():
    with pytest.raises(ValueError, match="int32"):
        KVCache.allocate(1, 2**27, 16, 1, 1, torch.float16, "meta")
