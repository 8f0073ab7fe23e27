"""The dtype a rank computes and keeps its KV cache in.

A configured dtype is honoured everywhere. ``auto`` picks, once at load:

- on CUDA, the checkpoint's own dtype (fp32 when it names none);
- on a CPU that multiplies bf16 natively (AMX, or avx512_bf16) and runs the
  compiled cpu backend: bf16. oneDNN then runs the products on those units and
  the compiled kernels read and round bf16 directly (kernels/cpu/fastmath.py); a
  144M-parameter Llama's 64-row decode step takes ~0.3x its fp32 time, and
  vLLM's CPU backend picks bf16 there too;
- on any other CPU: fp32. Without those instructions oneDNN emulates bf16
  products, slower than fp32 ones (vLLM's bf16 measured ~2.5x slower than its
  fp32 on an AVX2-only CPU), and the torch references convert every tensor to
  fp32 and back.

The choice and its reason are reported by the ranks (``model_info``), logged at
start-up and shown by ``GET /version``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import CheckpointError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class DtypeError(CheckpointError):
    """A dtype this runtime does not compute in."""


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # why: "configured", or what ``auto`` saw

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def cpu_bf16_instructions() -> str | None:
    """``"AMX"`` or ``"avx512_bf16"`` when this CPU multiplies bf16 natively and
    this torch's oneDNN can use it; ``None`` otherwise."""
    if not torch.backends.mkldnn.is_available():
        return None
    probes = (("AMX", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"))
    for name, probe in probes:
        supported = getattr(torch.cpu, probe, None)
        if supported is not None and supported():
            return name
    return None


def choose_dtype(
    dtype: str | torch.dtype,
    checkpoint_dtype: str | None,
    device: str | torch.device,
    kernel_backend: str = "auto",
) -> DtypeChoice:
    """The dtype for ``dtype`` (a name, a torch dtype or ``"auto"``) on ``device``,
    for a checkpoint saved in ``checkpoint_dtype``; see the module's docstring."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise DtypeError(f"unsupported dtype {dtype}")
        return DtypeChoice(dtype, "configured")
    if dtype != "auto":
        try:
            return DtypeChoice(DTYPES[dtype], "configured")
        except KeyError:
            raise DtypeError(
                f"unsupported dtype {dtype!r}; use auto, float32, float16 or bfloat16"
            ) from None
    if torch.device(device).type != "cpu":
        saved = DTYPES.get(str(checkpoint_dtype).removeprefix("torch."))
        if saved is None:
            return DtypeChoice(torch.float32, "auto: the checkpoint names no dtype")
        return DtypeChoice(saved, "auto: the checkpoint's dtype on an accelerator")
    if kernel_backend not in ("auto", "cpu") or not _compiled_kernels():
        return DtypeChoice(
            torch.float32, "auto: the CPU's compiled kernels are not in use (fp32 is faster)"
        )
    units = cpu_bf16_instructions()
    if units is None:
        return DtypeChoice(
            torch.float32, "auto: this CPU has no bf16 instructions (AMX, avx512_bf16)"
        )
    return DtypeChoice(torch.bfloat16, f"auto: this CPU multiplies bf16 natively ({units})")


def _compiled_kernels() -> bool:
    from ..kernels.registry import numba_available

    return numba_available()
