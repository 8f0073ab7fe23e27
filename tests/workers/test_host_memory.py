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
