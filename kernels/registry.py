"""Backend selection: Triton kernels on CUDA; on CPU the compiled CPU kernels
(``cpu``, :mod:`.cpu`, which pick among themselves through one dispatch table by
the instruction set, :mod:`.cpu.dispatch`), or the torch references alone
(``torch``). Experts run on the rows routed to each (:mod:`.experts`) on CPU, in
one grouped Triton kernel per projection on CUDA.

The Triton modules are imported only when the triton backend is requested, so
importing this package or using the torch or cpu backend never imports triton.

``get_ops(..., invariant=True)``: the ops of an engine that computes every row
batch-invariantly (``batch_invariant``, docs/model-runtime.md): the cpu backend
sends every prefill piece to the row kernels, as decode rows (:mod:`.cpu.plan`),
and Triton runs one kernel, one split, for decode rows and pieces alike
(:mod:`.attention_plan`). The torch references batch rows through torch's own
products and attention, and refuse the mode by name.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .attention_layer import AttentionLayer

BACKENDS = ("auto", "triton", "cpu", "torch")


def _nothing_to_prepare(meta, **_: Any) -> None:
    return None


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
    # an attention layer bound to its caches and tables at load (AttentionLayer's arguments)
    attention_layer: Callable[..., AttentionLayer] = AttentionLayer
    # what the kernels read of a step's AttentionMetadata, derived once a step (into .host):
    # prepare(meta, num_heads=, block_size=, windows=)
    prepare: Callable[..., Any] = _nothing_to_prepare
    # every row attended in an order no other row of the step changes (get_ops(invariant=))
    invariant: bool = False

    def with_attention(self, paged_attention: Callable[..., torch.Tensor]) -> KernelOps:
        """These ops with another ``paged_attention``; ``rotary_store_attend``, which
        attends too, becomes this backend's ``rotary_store_kv``, then it, and layers
        compose the ops (no backend's bound layer, whose kernels attend their own way)."""
        reference = importlib.import_module(f"{__package__}.reference")
        return dataclasses.replace(
            self,
            paged_attention=paged_attention,
            rotary_store_attend=reference.rotary_store_then_attend(
                self.rotary_store_kv, paged_attention
            ),
            attention_layer=AttentionLayer,
        )


def triton_available() -> bool:
    """Whether triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def numba_available() -> bool:
    """Whether numba is installed (checked without importing it)."""
    return importlib.util.find_spec("numba") is not None


def _module(name: str):
    return importlib.import_module(f"{__package__}.{name}")


@functools.cache
def _load(name: str, invariant: bool = False) -> KernelOps:
    reference = _module("reference")
    if name == "torch":
        return KernelOps(
            name="torch",
            store_kv=reference.store_kv,
            paged_attention=reference.paged_attention,
            rms_norm=reference.rms_norm,
            rotary_embedding=reference.rotary_embedding,
            rotary_store_kv=reference.rotary_store_kv,
            rotary_store_attend=reference.rotary_store_attend,
            silu_mul=reference.silu_mul,
            gelu_tanh_mul=reference.gelu_tanh_mul,
            fused_experts=_module("experts").fused_experts,
        )

    def mode(op):  # the batch-invariant variant of an op that attends: a keyword of its own
        return functools.partial(op, invariant=True) if invariant else op

    if name == "cpu":
        rotary, attention = _module("cpu.rotary"), _module("cpu.attention")
        activation, layer = _module("cpu.activation"), _module("cpu.layer")
        return KernelOps(
            name="cpu",
            store_kv=rotary.store_kv,
            paged_attention=mode(attention.paged_attention),
            rms_norm=_module("cpu.norm").rms_norm,
            rotary_embedding=rotary.rotary_embedding,
            rotary_store_kv=rotary.rotary_store_kv,
            rotary_store_attend=mode(layer.rotary_store_attend),
            silu_mul=activation.silu_mul,
            gelu_tanh_mul=activation.gelu_tanh_mul,
            fused_experts=_module("experts").fused_experts,
            attention_layer=layer.CpuAttentionLayer,
            prepare=mode(_module("cpu.plan").prepare),
            invariant=invariant,
        )
    ops, attn, cache = _module("triton_ops"), _module("triton_attention"), _module("triton_cache")
    rotary_store_kv = reference.rotary_then_store(ops.rotary_embedding, cache.store_kv)
    paged_attention = mode(attn.paged_attention)
    return KernelOps(
        name=name,
        store_kv=cache.store_kv,
        paged_attention=paged_attention,
        rms_norm=ops.rms_norm,
        rotary_embedding=ops.rotary_embedding,
        rotary_store_kv=rotary_store_kv,
        rotary_store_attend=reference.rotary_store_then_attend(rotary_store_kv, paged_attention),
        silu_mul=ops.silu_mul,
        gelu_tanh_mul=ops.gelu_tanh_mul,
        fused_experts=mode(_module("triton_experts").fused_experts),
        invariant=invariant,
    )


def get_ops(backend: str = "auto", device: torch.device | str | None = None, *,
            invariant: bool = False) -> KernelOps:  # fmt: skip
    """Return the ops of ``backend`` ("auto", "triton", "cpu" or "torch").

    "auto" picks triton when ``device`` is a CUDA device (``None`` means CUDA
    if available) and triton is installed; otherwise "cpu" when numba is
    installed, else the torch references. ``invariant``: the batch-invariant
    variants (the module's docstring); the torch backend refuses them.
    """
    name = backend_name(backend, device)
    if invariant:
        check_batch_invariant(name, device)
    return _load(name, invariant)


def check_batch_invariant(backend: str, device: torch.device | str | None = None) -> None:
    """Refuses, by name, a backend that does not compute batch-invariantly."""
    if backend_name(backend, device) == "torch":
        raise ValueError(
            "batch_invariant: the torch kernel backend cannot compute each row apart from its "
            "batch (its references run torch's products and attention, which choose their "
            "kernels by the batch's shape); use kernel_backend cpu (numba) or triton"
        )


def backend_name(backend: str = "auto", device: torch.device | str | None = None) -> str:
    """The backend ``backend`` resolves to on ``device`` (see :func:`get_ops`)."""
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
    return backend
