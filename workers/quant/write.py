"""Quantized checkpoints written from dense ones, by rounding to nearest (no data).

:func:`quantize_checkpoint` reads a dense checkpoint directory and writes the
same model with its projections quantized in one of the formats served
(:data:`SCHEMES`), as the tools that make them store it: compressed-tensors
(what llm-compressor's W8A8 / W4A16 / FP8_DYNAMIC recipes write for a
round-to-nearest scheme), GPTQ (``checkpoint_format: gptq``, zero points minus
one, ``desc_act`` with a permuted ``g_idx``) and AWQ GEMM. Scales are computed
as each tool computes them from a weight's range and stored in the checkpoint's
dtype (fp16 for GPTQ and AWQ); the values are quantized with the stored scale,
so a reader's dequantization is exact. Embeddings, norms, the MoE router and
the LM head stay dense, as the tools' usual recipes leave them. Tests and
``iterserve bench checkpoint --quantize`` use it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .formats import AWQ_ORDER

SCHEMES = ("w8a8", "w4a16", "w4a16-asym", "w8a16", "fp8", "fp8-block", "gptq", "gptq-8bit",
           "awq")  # fmt: skip
# the projections the tools quantize (transformers' names, Mixtral's experts' among them)
_PROJECTION = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|qkv_proj|gate_proj|up_proj|down_proj|gate_up_proj|w1|w2|w3)"
    r"\.weight$"
)
FP8_MAX = 448.0


def _pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``[rows, n]`` (n a multiple of 32 / bits) packed along the last
    dimension from the lowest bits up: int32 ``[rows, n * bits / 32]``."""
    per = 32 // bits
    v = values.to(torch.int64).view(values.shape[0], -1, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (v << shifts).sum(dim=-1)
    return words.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else \
        ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # fmt: skip


def _groups(w: torch.Tensor, size: int) -> torch.Tensor:
    """``[out, in]`` as ``[out, in / size, size]``."""
    return w.view(w.shape[0], -1, size)


def _ct_args(bits: int, kind: str, strategy: str, group_size=None, symmetric=True, block=None,
             dynamic=False) -> dict:  # fmt: skip
    return {"num_bits": bits, "type": kind, "symmetric": symmetric, "group_size": group_size,
            "strategy": strategy, "block_structure": block, "dynamic": dynamic,
            "actorder": None, "observer": None if dynamic else "minmax", "observer_kwargs": {}}  # fmt: skip


def _quantize_ct(w: torch.Tensor, scheme: str, group_size: int, dtype) -> dict[str, torch.Tensor]:
    """One weight as compressed-tensors stores it under ``scheme``."""
    w = w.float()
    out_features, in_features = w.shape
    if scheme == "w8a8":
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.5).clamp(min=1e-12).to(dtype)
        q = torch.round(w / scale.float()).clamp(-128, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}
    if scheme in ("fp8", "fp8-block"):
        if scheme == "fp8":
            scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12).to(dtype)
            expanded = scale.float()
        else:
            blocks = w.view(out_features // 128, 128, in_features // 128, 128)
            scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12).to(dtype)
            expanded = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
        q = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale}
    bits = 8 if scheme == "w8a16" else 4
    offset, top = 1 << (bits - 1), (1 << bits) - 1
    g = _groups(w, group_size)
    if scheme == "w4a16-asym":
        low, high = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
        scale = ((high - low) / top).clamp(min=1e-12).to(dtype)
        zero = torch.round(-offset - low / scale.float()).clamp(-offset, offset - 1)
    else:
        scale = (g.abs().amax(dim=2) / (top / 2)).clamp(min=1e-12).to(dtype)
        zero = torch.zeros_like(scale, dtype=torch.float32)
    q = torch.round(g / scale.float()[..., None]) + zero[..., None]
    q = q.clamp(-offset, offset - 1).view(out_features, in_features)
    tensors = {"weight_packed": _pack_int32(q + offset, bits), "weight_scale": scale,
               "weight_shape": torch.tensor([out_features, in_features])}  # fmt: skip
    if scheme == "w4a16-asym":  # packed along the outputs
        tensors["weight_zero_point"] = _pack_int32(
            (zero + offset).T.contiguous(), bits
        ).T.contiguous()
    return tensors


def _ct_config(scheme: str, group_size: int) -> dict:
    if scheme == "w8a8":
        fmt, weights = "int-quantized", _ct_args(8, "int", "channel")
        activations = _ct_args(8, "int", "token", dynamic=True)
    elif scheme in ("fp8", "fp8-block"):
        fmt = "float-quantized"
        weights = _ct_args(8, "float", "channel") if scheme == "fp8" else \
            _ct_args(8, "float", "block", block=[128, 128])  # fmt: skip
        activations = _ct_args(8, "float", "token" if scheme == "fp8" else "group",
                               group_size=None if scheme == "fp8" else 128, dynamic=True)  # fmt: skip
    else:
        bits = 8 if scheme == "w8a16" else 4
        fmt, activations = "pack-quantized", None
        weights = _ct_args(bits, "int", "group", group_size, symmetric=scheme != "w4a16-asym")
    return {
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": activations,
                                      "output_activations": None, "format": fmt}},
        "format": fmt, "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"], "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed",
        "sparsity_config": {}, "transform_config": {}, "version": "0.20.1",
    }  # fmt: skip


def _gptq_module(w: torch.Tensor, bits: int, group_size: int, perm: torch.Tensor | None,
                 dtype) -> dict[str, torch.Tensor]:  # fmt: skip
    """GPTQ's tensors of one weight: groups over the inputs in ``perm``'s order
    (``desc_act``), symmetric, zero points stored minus one."""
    w = w.float()
    out_features, in_features = w.shape
    top = (1 << bits) - 1
    order = perm if perm is not None else torch.arange(in_features)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // group_size).to(torch.int32)
    groups = in_features // group_size
    scales = torch.empty(groups, out_features)
    for g in range(groups):
        cols = w[:, order[g * group_size : (g + 1) * group_size]]
        scales[g] = cols.abs().amax(dim=1) * 2 / top
    scales = scales.clamp(min=1e-8).to(torch.float16)
    zero = (top + 1) // 2
    q = torch.round(w / scales.float()[g_idx.long()].T) + zero
    q = q.clamp(0, top).to(torch.int64)
    zeros = torch.full((groups, out_features), zero - 1)
    return {"qweight": _pack_int32(q, bits).T, "qzeros": _pack_int32(zeros, bits),
            "scales": scales, "g_idx": g_idx}  # fmt: skip


def _awq_module(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    w = w.float()
    out_features, in_features = w.shape
    g = _groups(w, group_size)
    low, high = g.amin(dim=2), g.amax(dim=2)
    scales = ((high - low) / 15).clamp(min=1e-8).to(torch.float16)  # [out, groups]
    zeros = torch.round(-low / scales.float()).clamp(0, 15)
    q = (torch.round(g / scales.float()[..., None]) + zeros[..., None]).clamp(0, 15)
    q = q.view(out_features, in_features)
    order = list(AWQ_ORDER)

    def awq_pack(values: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out / 8]
        slots = values.view(values.shape[0], -1, 8)[:, :, order]
        return _pack_int32(slots.reshape(values.shape[0], -1), 4)

    return {"qweight": awq_pack(q.T.contiguous()), "qzeros": awq_pack(zeros.T.contiguous()),
            "scales": scales.T.contiguous()}  # fmt: skip


def quantize_checkpoint(src: str | Path, dst: str | Path, scheme: str, *, group_size: int = 128,
                        desc_act: bool = False, seed: int = 0) -> Path:  # fmt: skip
    """Writes ``src``'s model into ``dst`` with its projections quantized by ``scheme``
    (:data:`SCHEMES`); ``group_size`` for the grouped schemes, ``desc_act`` (GPTQ)
    groups each weight's inputs in a random order of ``seed``'s. Other files are copied."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    dtype = getattr(torch, config.get("torch_dtype") or config.get("dtype") or "float32")
    files = sorted(src.glob("*.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, int], torch.Tensor] = {}
    for file in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                t = f.get_tensor(name)
                if not _PROJECTION.search(name):
                    out[name] = t
                    continue
                module = name.removesuffix(".weight")
                if scheme.startswith("gptq"):
                    perm = None
                    if desc_act:  # q/k/v (and gate/up) read one input: one order for them
                        key = (module.rsplit(".", 1)[0], t.shape[1])
                        if key not in perms:
                            perms[key] = torch.randperm(t.shape[1], generator=gen)
                        perm = perms[key]
                    parts = _gptq_module(t, 8 if scheme == "gptq-8bit" else 4, group_size, perm,
                                         dtype)  # fmt: skip
                    if not desc_act:
                        parts.pop("g_idx")
                elif scheme == "awq":
                    parts = _awq_module(t, group_size)
                else:
                    parts = _quantize_ct(t, scheme, group_size, dtype)
                out.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
        save_file(out, dst / file.name, metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.exists():
        names = {}
        for file in files:
            with safe_open(dst / file.name, framework="pt") as f:
                names.update({n: file.name for n in f.keys()})  # noqa: SIM118
        (dst / index.name).write_text(json.dumps({"metadata": {}, "weight_map": names}))
    for other in src.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name not in (
            "config.json", "model.safetensors.index.json"
        ):  # fmt: skip
            shutil.copy(other, dst / other.name)
    config["quantization_config"] = _quant_config(scheme, group_size, desc_act)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _quant_config(scheme: str, group_size: int, desc_act: bool) -> dict:
    if scheme.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 8 if scheme == "gptq-8bit" else 4,
                "group_size": group_size, "desc_act": desc_act, "sym": True,
                "checkpoint_format": "gptq", "lm_head": False}  # fmt: skip
    if scheme == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    return _ct_config(scheme, group_size)
