"""Each format's tensors of one module, this rank's slice, in one form.

:func:`read` returns a :class:`Part`: the module's values as ``[out, in]``
(int8 for W8A8; unsigned integers or fp8 bytes in uint8 for weight-only), its
scales and zero points as ``[out, groups]`` fp32 in the values' own units, and
the group each input belongs to. The bit layouts, as each format documents them:

- compressed-tensors ``pack-quantized``: ``weight_packed`` int32 ``[out, in * bits
  / 32]``, values packed along the input from the lowest bits up, each stored
  plus ``2**(bits - 1)`` (so unsigned); ``weight_zero_point`` likewise plus the
  offset, packed along the output ``[out * bits / 32, groups]``;
  ``weight_shape`` the unpacked ``[out, in]``; ``weight_g_idx`` each input's
  group under ``actorder``;
- GPTQ: ``qweight`` int32 ``[in * bits / 32, out]`` packed along the input,
  ``qzeros`` ``[groups, out * bits / 32]`` packed along the output, unsigned;
  ``checkpoint_format: gptq`` stores each zero point minus one; ``scales``
  ``[groups, out]``; ``g_idx`` ``[in]``;
- AWQ GEMM: ``qweight`` ``[in, out / 8]`` and ``qzeros`` ``[groups, out / 8]``,
  each int32 holding eight outputs in the order 0, 2, 4, 6, 1, 3, 5, 7 from the
  lowest bits; ``scales`` ``[groups, out]``;
- compressed-tensors ``int-quantized`` / ``naive-quantized``: int8 ``weight``;
  ``float-quantized`` and ``fp8``: e4m3 ``weight``; ``weight_scale`` per tensor
  (one value), per channel ``[out, 1]``, per group ``[out, groups]`` or per
  block ``[out / rows, in / columns]``; fp8's ``weight_scale_inv`` per block.

A tensor of the wrong shape or dtype, a missing one (``g_idx`` with
``desc_act``), a slice that splits a packed word or a group: refused naming the
tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...kernels.quant import Activations
from ..config import CheckpointError
from .config import Scheme

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output 8c + AWQ_ORDER[i] sits in slot i of word c


@dataclass
class Part:
    """One module's slice: ``values`` ``[out, in]``, ``scales``/``zeros`` ``[out,
    groups]``, ``group_of`` ``[in]`` (int64)."""

    values: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_of: torch.Tensor
    activations: Activations | None = None


def _bad(name: str, what: str) -> CheckpointError:
    return CheckpointError(f"weights: {name} {what}")


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words ``[rows, words]`` of ``bits``-bit values from the lowest bits up,
    as uint8 ``[rows, count]``."""
    data = packed.contiguous().view(torch.uint8)  # little-endian: the lowest bits first
    if bits == 4:
        data = torch.stack((data & 15, data >> 4), dim=-1).view(packed.shape[0], -1)
    return data[:, :count].contiguous()


def _check(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> None:
    if ckpt.shape(name) != shape:
        raise _bad(name, f"has shape {ckpt.shape(name)}, expected {shape}")


def _get(ckpt: Checkpoint, name: str, dim, start, stop, dtypes) -> torch.Tensor:
    t = ckpt.get(name, dim, start, stop) if dim is not None else ckpt.get(name)
    if t.dtype not in dtypes:
        raise _bad(name, f"is {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    return t


def _words(name: str, start: int, stop: int, per_word: int) -> tuple[int, int]:
    if start % per_word or stop % per_word:
        raise _bad(name, f"cannot be split at {start}:{stop}: {per_word} values share a word")
    return start // per_word, stop // per_word


def _groups(name: str, in_features: int, size: int | None, g_idx: torch.Tensor | None,
            num_groups: int) -> torch.Tensor:  # fmt: skip
    """Each input's group: ``g_idx``, else consecutive runs of ``size`` (all one
    group when None)."""
    if g_idx is not None:
        if g_idx.shape != (in_features,):
            raise _bad(name, f"has shape {tuple(g_idx.shape)}, expected ({in_features},)")
        group_of = g_idx.long()
    elif size is None:
        group_of = torch.zeros(in_features, dtype=torch.long)
    else:
        group_of = torch.arange(in_features) // size
    if in_features and (int(group_of.min()) < 0 or int(group_of.max()) >= num_groups):
        raise _bad(name, f"names a group outside the {num_groups} groups of the scales")
    return group_of


def read(ckpt: Checkpoint, module: str, scheme: Scheme, full: tuple[int, int],
         dim: int | None, start: int = 0, stop: int | None = None) -> Part:  # fmt: skip
    """``module``'s tensors (``full``: its unpacked ``[out, in]``), the slice
    ``start:stop`` along ``dim`` (0: outputs, 1: inputs; None: whole)."""
    stop = full[dim] if dim is not None and stop is None else stop
    reader = {"gptq": _gptq, "awq": _awq, "pack-quantized": _packed}.get(scheme.format, _plain)
    part = reader(ckpt, module, scheme, full, dim, start, stop)
    scales = part.scales
    if not torch.isfinite(scales).all() or (scales <= 0).any():
        raise _bad(f"{module}'s scales", "hold a value that is not finite and positive")
    return part


def _slice_groups(part_scales: torch.Tensor, dim, start, stop) -> torch.Tensor:
    """Scales ``[out, groups]`` of all outputs, this slice's rows when split by output."""
    return part_scales[start:stop] if dim == 0 else part_scales


def _global_groups(in_features, scheme: Scheme, g_idx, name, num_groups, dim, start, stop):
    group_of = _groups(name, in_features, scheme.group_size, g_idx, num_groups)
    return group_of[start:stop] if dim == 1 else group_of


def _plain(ckpt, module, scheme: Scheme, full, dim, start, stop) -> Part:
    """int8 or fp8 ``weight`` with its ``weight_scale`` (fp8: ``weight_scale_inv``)."""
    name = f"{module}.weight"
    _check(ckpt, name, full)
    fp8 = scheme.number != "int"
    dtypes = (torch.float8_e4m3fn,) if fp8 else (torch.int8,)
    values = _get(ckpt, name, dim, start, stop, dtypes)
    out_features, in_features = full
    scale_name = f"{module}.weight_scale"
    if scheme.format == "fp8" and scheme.strategy == "block":
        scale_name = f"{module}.weight_scale_inv"
    scale = _get(ckpt, scale_name, None, 0, None, (torch.float32, torch.bfloat16, torch.float16))
    per_output = _per_output_scales(scale.float(), scheme, full, scale_name)  # [out, groups]
    zeros = None
    if not scheme.symmetric:
        zp_name = f"{module}.weight_zero_point"
        zeros = _per_output_scales(ckpt.get(zp_name).float(), scheme, full, zp_name)
    num_groups = per_output.shape[1]
    group_of = _global_groups(in_features, scheme, None, name, num_groups, dim, start, stop)
    scales = _slice_groups(per_output, dim, start, stop)
    zeros = None if zeros is None else _slice_groups(zeros, dim, start, stop)
    if scheme.w8a8:
        return Part(values, scales, zeros, group_of, _static_activations(ckpt, module, scheme))
    if fp8:
        return Part(values.view(torch.uint8), scales, zeros, group_of)
    offset = 128  # int8 as unsigned: + 128, and the zero point with it
    zeros = offset + (zeros if zeros is not None else torch.zeros_like(scales))
    return Part((values.to(torch.int16) + offset).to(torch.uint8), scales, zeros, group_of)


def _per_output_scales(scale: torch.Tensor, scheme: Scheme, full, name) -> torch.Tensor:
    """A ``weight_scale`` as ``[out, groups]``: a tensor's one value, a channel's
    ``[out, 1]``, a group's ``[out, groups]``, a block's rows repeated a row."""
    out_features, in_features = full
    if scheme.strategy == "tensor":
        if scale.numel() != 1:
            raise _bad(name, f"has {scale.numel()} values; a per-tensor scale has one")
        return scale.reshape(1, 1).expand(out_features, 1).contiguous()
    if scheme.strategy == "channel":
        if scale.numel() != out_features:
            raise _bad(name, f"has shape {tuple(scale.shape)}, expected ({out_features}, 1)")
        return scale.reshape(out_features, 1)
    if scheme.strategy == "group":
        groups = -(-in_features // scheme.group_size)
        if tuple(scale.shape) != (out_features, groups):
            raise _bad(name, f"has shape {tuple(scale.shape)}, expected ({out_features}, "
                             f"{groups}): groups of {scheme.group_size}")  # fmt: skip
        return scale
    rows = -(-out_features // scheme.block_rows)
    columns = -(-in_features // scheme.group_size)
    if tuple(scale.shape) != (rows, columns):
        raise _bad(name, f"has shape {tuple(scale.shape)}, expected ({rows}, {columns}): "
                         f"blocks of {scheme.block_rows}x{scheme.group_size}")  # fmt: skip
    return scale.repeat_interleave(scheme.block_rows, dim=0)[:out_features]


def _static_activations(ckpt, module: str, scheme: Scheme) -> Activations:
    a = scheme.activations
    if a.dynamic:
        return a
    scale = float(ckpt.get(f"{module}.input_scale").float().max())
    if not scale > 0 or scale == float("inf"):
        raise _bad(f"{module}.input_scale", f"is {scale}; it must be finite and positive")
    zero = 0
    if not a.symmetric:
        zero = int(ckpt.get(f"{module}.input_zero_point").reshape(-1)[0])
    return Activations(dynamic=False, per_token=False, symmetric=a.symmetric, scale=scale,
                       zero=zero)  # fmt: skip


def _packed(ckpt, module, scheme: Scheme, full, dim, start, stop) -> Part:
    """compressed-tensors ``pack-quantized``."""
    bits, per_word = scheme.bits, 32 // scheme.bits
    out_features, in_features = full
    shape_name = f"{module}.weight_shape"
    if [int(v) for v in ckpt.get(shape_name).reshape(-1)] != list(full):
        raise _bad(shape_name, f"is {ckpt.get(shape_name).tolist()}, expected {list(full)}")
    name = f"{module}.weight_packed"
    _check(ckpt, name, (out_features, -(-in_features // per_word)))
    if dim == 1:
        lo, hi = _words(name, start, stop, per_word)
        values = unpack(_get(ckpt, name, 1, lo, hi, (torch.int32,)), bits, stop - start)
    else:
        words = _get(ckpt, name, dim, start, stop, (torch.int32,))
        values = unpack(words, bits, in_features)
    scale_name = f"{module}.weight_scale"
    scales = _per_output_scales(ckpt.get(scale_name).float(), scheme, full, scale_name)
    num_groups = scales.shape[1]
    offset = 1 << (bits - 1)
    zeros = torch.full_like(scales, float(offset))
    if not scheme.symmetric:
        zp_name = f"{module}.weight_zero_point"
        _check(ckpt, zp_name, (-(-out_features // per_word), num_groups))
        zp = unpack(_get(ckpt, zp_name, None, 0, None, (torch.int32,)).T, bits, out_features)
        zeros = zp.T.float()  # [out, groups], stored plus the offset like the values
    g_idx = None
    if scheme.actorder:
        g_idx = _get(ckpt, f"{module}.weight_g_idx", None, 0, None, (torch.int32, torch.int64))
    group_of = _global_groups(in_features, scheme, g_idx, f"{module}.weight_g_idx", num_groups,
                              dim, start, stop)  # fmt: skip
    return Part(values, _slice_groups(scales, dim, start, stop),
                _slice_groups(zeros, dim, start, stop), group_of)  # fmt: skip


def _gptq(ckpt, module, scheme: Scheme, full, dim, start, stop) -> Part:
    bits, per_word = scheme.bits, 32 // scheme.bits
    out_features, in_features = full
    groups = 1 if scheme.group_size is None else -(-in_features // scheme.group_size)
    name, zname, sname = (f"{module}.{t}" for t in ("qweight", "qzeros", "scales"))
    _check(ckpt, name, (in_features // per_word, out_features))
    _check(ckpt, zname, (groups, -(-out_features // per_word)))
    _check(ckpt, sname, (groups, out_features))
    if dim == 1:  # rows of qweight: inputs
        lo, hi = _words(name, start, stop, per_word)
        words = _get(ckpt, name, 0, lo, hi, (torch.int32,))
    else:
        words = _get(ckpt, name, 1 if dim == 0 else None, start, stop, (torch.int32,))
    values = unpack(words.T, bits, words.shape[0] * per_word)  # [out, in]
    scales = _get(ckpt, sname, None, 0, None, (torch.float16, torch.bfloat16, torch.float32))
    zeros = unpack(_get(ckpt, zname, None, 0, None, (torch.int32,)), bits, out_features).float()
    if scheme.zero_minus_one:
        zeros = zeros + 1
    g_idx = None
    gname = f"{module}.g_idx"
    if scheme.actorder:
        if gname not in ckpt:
            raise _bad(gname, "is missing: the checkpoint's desc_act needs each input's group")
        g_idx = _get(ckpt, gname, None, 0, None, (torch.int32, torch.int64))
    group_of = _global_groups(in_features, scheme, g_idx, gname, groups, dim, start, stop)
    return Part(values, _slice_groups(scales.float().T, dim, start, stop),
                _slice_groups(zeros.T.contiguous(), dim, start, stop), group_of)  # fmt: skip


def _awq_unpack(words: torch.Tensor, count: int) -> torch.Tensor:
    """AWQ's int32 words ``[rows, count / 8]`` as ``[rows, count]`` in output order."""
    slots = unpack(words, 4, words.shape[1] * 8).view(words.shape[0], -1, 8)
    order = torch.tensor(AWQ_ORDER)
    out = torch.empty_like(slots)
    out[:, :, order] = slots
    return out.view(words.shape[0], -1)[:, :count]


def _awq(ckpt, module, scheme: Scheme, full, dim, start, stop) -> Part:
    out_features, in_features = full
    groups = -(-in_features // scheme.group_size)
    name, zname, sname = (f"{module}.{t}" for t in ("qweight", "qzeros", "scales"))
    _check(ckpt, name, (in_features, out_features // 8))
    _check(ckpt, zname, (groups, out_features // 8))
    _check(ckpt, sname, (groups, out_features))
    if dim == 0:
        lo, hi = _words(name, start, stop, 8)
        values = _awq_unpack(_get(ckpt, name, 1, lo, hi, (torch.int32,)), stop - start).T
        zeros = _awq_unpack(_get(ckpt, zname, 1, lo, hi, (torch.int32,)), stop - start)
        scales = _get(ckpt, sname, 1, start, stop, (torch.float16, torch.bfloat16, torch.float32))
    else:
        words = _get(ckpt, name, 0 if dim == 1 else None, start, stop, (torch.int32,))
        values = _awq_unpack(words, out_features).T
        zeros = _awq_unpack(_get(ckpt, zname, None, 0, None, (torch.int32,)), out_features)
        scales = _get(ckpt, sname, None, 0, None, (torch.float16, torch.bfloat16, torch.float32))
    group_of = _global_groups(in_features, scheme, None, name, groups, dim, start, stop)
    return Part(values.contiguous(), scales.float().T.contiguous(), zeros.T.float().contiguous(),
                group_of)  # fmt: skip
