"""A rank keeps the memory its steps free in the heap (glibc's malloc thresholds)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc")
def test_keep_freed_memory_sets_the_thresholds():
    # In a child process, so the test process's allocator is left as it was.
    code = "from iterserve.workers.host_memory import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def _huge_pages_possible() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _huge_pages_possible(), reason="no transparent huge pages here")
def test_a_large_host_tensor_is_put_on_huge_pages_and_a_small_one_is_not():
    import torch

    from iterserve.kernels.cpu.linear import pack
    from iterserve.kernels.cpu.memory import HUGE_PAGE, tensor_on_huge_pages

    big = torch.zeros(16 << 20, dtype=torch.uint8)  # touched: collapsed where Linux can
    assert tensor_on_huge_pages(big) >= (16 << 20) - HUGE_PAGE  # its whole 2 MiB pages
    assert tensor_on_huge_pages(torch.empty(1024, dtype=torch.uint8)) == 0  # holds none
    packed = pack(torch.zeros(4096, 1024, dtype=torch.bfloat16))  # oneDNN's own memory too
    assert packed is None or tensor_on_huge_pages(packed.onednn) > 0


def test_the_kv_cache_starts_zeroed():
    import torch

    from iterserve.workers.kv_cache import KVCache

    cache = KVCache.allocate(2, 600, 16, 2, 64, torch.float32, "cpu")  # 9.8 MB a tensor
    assert all(int(t.count_nonzero()) == 0 for t in cache.keys + cache.values)
