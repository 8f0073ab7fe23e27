"""How the CPU kernels are compiled: numba, for the instruction set of :mod:`.isa`.

Every kernel is ``@jit()``: ``fastmath``, no bounds checks, the GIL released,
cached on disk after its first compile (numba keys the cache by the target's
features, so a capped level compiles and caches its own), and numpy's error
model: a float division by zero gives inf rather than raising, which spares every
division its branch, so loops holding one vectorize. numba is told the features
to compile for (:func:`.isa.numba_features`) before its first compile, unless the
user set ``NUMBA_CPU_FEATURES``. Without numba the kernels are plain Python that
nothing calls (:func:`available`).
"""

from __future__ import annotations

import os

import torch

from . import isa

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; degrade rather than fail
    numba = None


def available() -> bool:
    """Whether the compiled kernels can run here (numba imports)."""
    return numba is not None


# The dtypes the kernels take (numba has no fp16): a bf16 tensor reaches a kernel as
# its bits (:mod:`.fastmath`).
DTYPES = (torch.float32, torch.bfloat16)


def compiled(*tensors: object) -> bool:
    """Whether the compiled kernels take these arguments (else the reference, whose
    checks name whatever is wrong with them): fp32 or bf16 CPU tensors. ``is_cpu``
    rather than ``device``, which builds a device object: these guards run before
    every op of a layer, cold after each product (docs/kernels.md)."""
    return available() and all(
        isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in DTYPES for t in tensors
    )


def configure() -> None:
    """Points numba at :func:`.isa.level`'s features; must run before its first
    compile in the process (this module's import, and :func:`.isa.cap`)."""
    if numba is not None and "NUMBA_CPU_FEATURES" not in os.environ:
        numba.config.CPU_FEATURES = isa.numba_features()


configure()

if numba is not None:
    prange = numba.prange

    def jit(parallel: bool = False):
        return numba.njit(
            parallel=parallel, fastmath=True, nogil=True, cache=True, boundscheck=False,
            error_model="numpy",
        )  # fmt: skip

    def use_threads(n: int) -> None:
        """Runs ``prange`` loops on ``n`` of numba's threads (at most as many as it has)."""
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))

else:  # pragma: no cover
    prange = range

    def jit(parallel: bool = False):
        return lambda fn: fn

    def use_threads(n: int) -> None:
        return None
