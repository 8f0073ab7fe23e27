"""Quantized checkpoints: what a checkpoint declares, what the engine serves, and
the weights the loader makes of it.

- :mod:`.config`: ``quantization_config`` read and checked (compressed-tensors,
  GPTQ, AWQ, FP8), refused by key where a variant is not computed;
- :mod:`.formats`: each format's tensors of one module, one rank's slice;
- :mod:`.load`: the model's quantized products read, assembled and packed for the
  rank's kernels (:mod:`iterserve.kernels.quant`), and ``fp8`` quantized at load;
- :mod:`.write`: quantized checkpoints written from dense ones (round to nearest),
  for tests and ``iterserve bench checkpoint --quantize``.

:func:`resolve` is the engine's ``quantization`` knob against the checkpoint's
own: absent, the checkpoint's; a method (vLLM's names), which must be the
checkpoint's; ``fp8`` on a dense checkpoint, quantized at load.
"""

from __future__ import annotations

from .config import METHODS, QuantConfig, Scheme, online_fp8, parse

__all__ = [
    "CHOICES",
    "METHODS",
    "QuantConfig",
    "Scheme",
    "describe",
    "ops",
    "parse",
    "resolve",
]

# The knob's values: the methods, and vLLM's names for the same checkpoints' kernels.
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors": "compressed-tensors"}
CHOICES = METHODS + tuple(ALIASES)


def resolve(requested: str | None, detected: QuantConfig | None) -> QuantConfig | None:
    """The quantization the engine serves: ``requested`` (the ``quantization`` knob,
    None: detected) against ``detected`` (the checkpoint's, None: dense). A mismatch
    is a ``ValueError`` naming both."""
    if requested is None:
        return detected
    method = ALIASES.get(requested, requested)
    if method not in METHODS:
        raise ValueError(f"quantization: {requested!r} is not served; use one of "
                         f"{', '.join(CHOICES)}, or leave it unset to read the checkpoint's")  # fmt: skip
    if detected is None:
        if method == "fp8":
            return online_fp8()
        raise ValueError(f"quantization: {requested!r}, but the checkpoint has no "
                         "quantization_config (a dense checkpoint is quantized at load only "
                         "as fp8)")  # fmt: skip
    if detected.method != method:
        raise ValueError(f"quantization: {requested!r}, but the checkpoint's "
                         f"quantization_config says {detected.method!r}")  # fmt: skip
    return detected


def describe(config: QuantConfig | None, device: str = "cpu") -> str | None:
    """One phrase for ``/version`` and the start-up line (None for a dense model); on
    a CPU, fp8 activations are said to be computed weight-only."""
    if config is None:
        return None
    phrase = config.describe()
    if str(device).startswith("cpu") and any(s.fp8_activations for _, s in config.groups):
        phrase += " (fp8 weights widened in bf16/fp32 products on a CPU: weight-only)"
    return phrase


def ops(config: QuantConfig | None) -> tuple[str, ...]:
    """The CPU dispatch table's ops ``config``'s products run (``/version``'s kernels)."""
    if config is None:
        return ()
    return tuple(dict.fromkeys("linear.w8a8" if s.w8a8 else "linear.wx" for _, s in config.groups))
