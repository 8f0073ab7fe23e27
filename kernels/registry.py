"""Backend selection: Triton kernels on CUDA; on CPU the torch references with
attention, norms, rotary and the KV store compiled by numba (``cpu``), or the
references alone (``torch``). Experts run on the rows routed to each
(:mod:`.experts`) on CPU, in one grouped Triton kernel per projection on CUDA.

The Triton modules are imported only when the triton backend is requested, so
importing this package or using the torch or cpu backend never imports triton.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "triton", "cpu", "torch")


@dataclass(frozen=True)
class KernelOps:
    """The serving ops of one backend; every backend has the same signatures."""

    name: str  # "triton" | "cpu" | "torch"
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # rotary_embedding, then store_kv of the rotated key; returns the rotated query
    rotary_store_kv: Callable[..., torch.Tensor]
    # a product's qkv rows split into heads, rotary_store_kv, then paged_attention
    rotary_store_attend: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]
    gelu_tanh_mul: Callable[..., torch.Tensor]
    fused_experts: Callable[..., torch.Tensor]

    def with_attention(self, paged_attention: Callable[..., torch.Tensor]) -> KernelOps:
        """These ops with another ``paged_attention``; ``rotary_store_attend``, which
        attends too, becomes this backend's ``rotary_store_kv``, then it."""
        reference = importlib.import_module(f"{__package__}.reference")
        return dataclasses.replace(
            self,
            paged_attention=paged_attention,
            rotary_store_attend=reference.rotary_store_then_attend(
                self.rotary_store_kv, paged_attention
            ),
        )


def triton_available() -> bool:
    """Whether triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def numba_available() -> bool:
    """Whether numba is installed (checked without importing it)."""
    return importlib.util.find_spec("numba") is not None


@functools.cache
def _load(name: str) -> KernelOps:
    reference = importlib.import_module(f"{__package__}.reference")
    if name in ("torch", "cpu"):
        ops, attn, cache = reference, reference, reference
        if name == "cpu":
            attn = importlib.import_module(f"{__package__}.cpu.attention")
            ops = cache = importlib.import_module(f"{__package__}.cpu.ops")
        experts = importlib.import_module(f"{__package__}.experts")
    else:
        experts = importlib.import_module(f"{__package__}.triton_experts")
        ops = importlib.import_module(f"{__package__}.triton_ops")
        attn = importlib.import_module(f"{__package__}.triton_attention")
        cache = importlib.import_module(f"{__package__}.triton_cache")
    rotary_store_kv = getattr(
        ops, "rotary_store_kv", reference.rotary_then_store(ops.rotary_embedding, cache.store_kv)
    )
    return KernelOps(
        name=name,
        store_kv=cache.store_kv,
        paged_attention=attn.paged_attention,
        rms_norm=ops.rms_norm,
        rotary_embedding=ops.rotary_embedding,
        rotary_store_kv=rotary_store_kv,
        rotary_store_attend=getattr(
            ops,
            "rotary_store_attend",
            reference.rotary_store_then_attend(rotary_store_kv, attn.paged_attention),
        ),
        silu_mul=ops.silu_mul,
        # torch's GELU is vectorized already: the cpu backend keeps the reference's.
        gelu_tanh_mul=getattr(ops, "gelu_tanh_mul", reference.gelu_tanh_mul),
        fused_experts=experts.fused_experts,
    )


def get_ops(backend: str = "auto", device: torch.device | str | None = None) -> KernelOps:
    """Return the ops of ``backend`` ("auto", "triton", "cpu" or "torch").

    "auto" picks triton when ``device`` is a CUDA device (``None`` means CUDA
    if available) and triton is installed; otherwise "cpu" when numba is
    installed, else the torch references.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        else:
            device_type = torch.device(device).type
        if device_type == "cuda" and triton_available():
            backend = "triton"
        else:
            backend = "cpu" if numba_available() else "torch"
    elif backend == "triton" and not triton_available():
        raise ValueError("backend 'triton' requested but triton is not installed")
    elif backend == "cpu" and not numba_available():
        raise ValueError("backend 'cpu' requested but numba is not installed")
    return _load(backend)
