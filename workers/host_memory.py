"""How a rank's process keeps the host memory its steps free.

A CPU step allocates and frees the same large temporaries every step (the
gathered KV of a decode batch, the MLP's activations, the logits). glibc's
malloc serves blocks past its mmap threshold (adjusted up to 32 MiB) with fresh
mappings, and gives the top of the heap back to the kernel once more than twice
that is free; either way the next step page-faults the same memory in again.
At 256 decode rows of the demo model that doubled the forward's time.
:func:`keep_freed_memory` fixes both thresholds, so freed memory stays in the
heap for the next step. The heap then holds on to at most the largest step's
temporaries, which the next step needs again. (Huge pages under what every step
reads, the weights and the KV cache: :mod:`iterserve.kernels.cpu.memory`.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

logger = logging.getLogger(__name__)

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
