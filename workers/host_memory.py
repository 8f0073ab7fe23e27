"""How a rank's process keeps the host memory its steps free.

A CPU step allocates and frees the same large temporaries every step (the
gathered KV of a decode batch, the MLP's activations, the logits). glibc's
malloc serves blocks past its mmap threshold (adjusted up to 32 MiB) with fresh
mappings, and gives the top of the heap back to the kernel once more than twice
that is free; either way the next step page-faults the same memory in again.
At 256 decode rows of the demo model that doubled the forward's time.
:func:`keep_freed_memory` fixes both thresholds, so freed memory stays in the
heap for the next step. The heap then holds on to at most the largest step's
temporaries, which the next step needs again.

:func:`advise_huge_pages` asks for transparent huge pages under a tensor not yet
touched: the KV cache, whose blocks a decode step reads from all over it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
HUGE_PAGE_BYTES = 2 << 20
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: bigger blocks are still mapped
TRIM_THRESHOLD_BYTES = 1 << 30


@functools.cache
def _libc_function(name: str):
    """``name`` from this process's C library, or None off Linux or where it lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return getattr(libc, name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Sets glibc's malloc thresholds in this process; False where there is no
    glibc (another libc, or an allocator preloaded in its place is left alone)."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    if not ok:
        logger.warning("could not set malloc's thresholds: CPU steps page-fault their buffers")
    return ok


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Asks the kernel to back ``tensor``'s memory with transparent huge pages
    (``madvise(MADV_HUGEPAGE)``, which a kernel in THP's ``madvise`` mode needs);
    only the whole 2 MiB pages inside it. Effective for memory not touched yet;
    False where there is no such page or the call is refused (another OS, THP off)."""
    madvise = _libc_function("madvise")
    if madvise is None:
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    start = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(start, end - start, MADV_HUGEPAGE) == 0
