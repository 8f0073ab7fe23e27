"""Quantized tiny checkpoints for the tests, and their dense references.

A quantized checkpoint is written from a tiny random model by
:func:`iterserve.workers.quant.write.quantize_checkpoint` (round to nearest).
Its reference is the dense checkpoint whose projections hold the weights the
quantized ones stand for, dequantized *independently of the loader*:

- compressed-tensors checkpoints by the ``compressed-tensors`` package's own
  decompressors (where it is installed; it installs on a CPU without pulling
  a torch of its own);
- GPTQ and AWQ by :func:`reference_dequantize`, written here bit by bit from each
  format's documented layout (one value at a time, no shared code with
  :mod:`iterserve.workers.quant.formats`).

transformers then runs the dense reference; a W8A8 checkpoint's reference is
transformers loading the quantized checkpoint itself (compressed-tensors
quantizes each product's input rows as the checkpoint says).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

AWQ_SLOT_OF_OUTPUT = (0, 4, 1, 5, 2, 6, 3, 7)  # output j of a word sits in slot ... (AWQ)


def _bits(word: int, slot: int, bits: int) -> int:
    return (word >> (slot * bits)) & ((1 << bits) - 1)


def reference_dequantize(fmt: str, tensors: dict[str, torch.Tensor], bits: int,
                         group_size: int) -> torch.Tensor:  # fmt: skip
    """A GPTQ (v1) or AWQ module's ``[out, in]`` fp32 weight, one value at a time."""
    qweight = tensors["qweight"].tolist()
    qzeros = tensors["qzeros"].tolist()
    scales = tensors["scales"].float()
    per = 32 // bits
    if fmt == "gptq":
        in_features, out_features = len(qweight) * per, len(qweight[0])
        g_idx = tensors.get("g_idx")
        w = torch.empty(out_features, in_features)
        for k in range(in_features):
            g = int(g_idx[k]) if g_idx is not None else k // group_size
            for n in range(out_features):
                q = _bits(qweight[k // per][n] & 0xFFFFFFFF, k % per, bits)
                z = _bits(qzeros[g][n // per] & 0xFFFFFFFF, n % per, bits) + 1  # stored minus one
                w[n, k] = (q - z) * scales[g, n]
        return w
    in_features, out_features = len(qweight), len(qweight[0]) * 8
    w = torch.empty(out_features, in_features)
    for k in range(in_features):
        g = k // group_size
        for n in range(out_features):
            slot = AWQ_SLOT_OF_OUTPUT[n % 8]
            q = _bits(qweight[k][n // 8] & 0xFFFFFFFF, slot, 4)
            z = _bits(qzeros[g][n // 8] & 0xFFFFFFFF, slot, 4)
            w[n, k] = (q - z) * scales[g, n]
    return w


def _ct_dequantize(config: dict, module_tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = config["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"],
                                input_activations=group["input_activations"])  # fmt: skip
    compressor = BaseCompressor.load_from_registry(group["format"])
    return compressor.decompress(dict(module_tensors), scheme)["weight"].float()


def dense_reference(quantized: Path, dense: Path, out: Path) -> Path:
    """``dense``'s checkpoint with every quantized module of ``quantized`` replaced by
    its dequantized weight (in ``dense``'s dtype), written to ``out``."""
    config = json.loads((quantized / "config.json").read_text())
    q = config["quantization_config"]
    method = q["quant_method"]
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(quantized / "model.safetensors", framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            tensors[name] = f.get_tensor(name)
    markers = {"gptq": ".qweight", "awq": ".qweight"}
    marker = markers.get(method, ".weight_scale")
    modules = sorted(n.removesuffix(marker) for n in tensors if n.endswith(marker))
    out.mkdir(parents=True, exist_ok=True)
    with safe_open(dense / "model.safetensors", framework="pt") as f:
        dense_tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    for module in modules:
        own = {n.removeprefix(module + "."): t for n, t in tensors.items()
               if n.startswith(module + ".") and "." not in n.removeprefix(module + ".")}  # fmt: skip
        if method == "compressed-tensors":
            w = _ct_dequantize(q, own)
        else:
            w = reference_dequantize(method, own, q["bits"], q["group_size"])
        dtype = dense_tensors[f"{module}.weight"].dtype
        dense_tensors[f"{module}.weight"] = w.to(dtype)
    save_file(dense_tensors, out / "model.safetensors", metadata={"format": "pt"})
    for other in dense.iterdir():
        if other.is_file() and other.suffix != ".safetensors":
            shutil.copy(other, out / other.name)
    return out
