"""iterserve.kernels: the model runtime's compute kernels.

Five ops, each with a Triton kernel and a pure-torch reference of the same
signature: ``store_kv`` (write K/V into the paged cache), ``paged_attention``
(causal attention of a mixed decode/prefill batch over the paged cache),
``rms_norm`` (optionally fused with the residual add), ``rotary_embedding``
and ``silu_mul``. :func:`get_ops` picks the backend: Triton on CUDA, torch
elsewhere. Importing this package does not import triton.
"""

from .cpu import isa as _isa  # noqa: F401  (caps oneDNN first, where ITERSERVE_CPU_ISA says so)
from .metadata import AttentionMetadata
from .registry import KernelOps, get_ops
from .rope import build_cos_sin_cache, compute_inv_freq

__all__ = ["AttentionMetadata", "KernelOps", "build_cos_sin_cache", "compute_inv_freq", "get_ops"]
