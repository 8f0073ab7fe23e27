"""What a checkpoint's ``quantization_config`` says, read once and checked.

:func:`parse` reads the four formats served (the ``quant_method`` key):

- ``compressed-tensors`` (llm-compressor's checkpoints): ``config_groups``, each a
  scheme for the modules its ``targets`` name (``Linear``, a module name or a
  ``re:`` pattern) less ``ignore``; its ``format`` (of the group, else of the
  config) says how the tensors are stored: ``int-quantized`` / ``naive-quantized``
  (int8 ``weight``, W8A8 with int8 activations, or W8A16), ``float-quantized``
  (fp8 ``weight``), ``pack-quantized`` (4 or 8 bits packed in int32
  ``weight_packed``, symmetric or with ``weight_zero_point``, groups of any size,
  ``weight_g_idx`` with ``actorder``);
- ``gptq``: ``bits`` 4 or 8, ``group_size``, ``desc_act`` (``g_idx``), ``sym``,
  ``checkpoint_format`` ``gptq`` (zero points stored minus one) or ``gptq_v2``;
  ``dynamic``'s ``-:`` patterns leave modules dense;
- ``awq``: 4 bits, ``version`` ``gemm``, zero points, ``modules_to_not_convert``;
- ``fp8`` (block-quantized FP8, ``weight_block_size``, or per tensor):
  ``weight`` in e4m3 with ``weight_scale_inv`` / ``weight_scale``.

A key whose value asks for something not computed is refused with its name (a
:class:`~iterserve.workers.config.CheckpointError`), before any tensor is read.
Which module a scheme covers is :meth:`QuantConfig.scheme_for`'s answer; for GPTQ,
AWQ and fp8 a module is quantized where its tensors are (``qweight``,
``weight_scale_inv``): their configs name no modules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ...kernels.quant import Activations
from ..config import CheckpointError

METHODS = ("compressed-tensors", "gptq", "awq", "fp8")
CT_FORMATS = ("int-quantized", "naive-quantized", "float-quantized", "pack-quantized")
FP8_KINDS = {8: "e4m3"}  # compressed-tensors' float 8-bit weights are e4m3


def _refuse(key: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"config.json: quantization_config.{key} is {value!r}; {why}")


@dataclass(frozen=True)
class Scheme:
    """How one module's weight is stored and computed."""

    format: str  # a CT_FORMATS entry, "gptq", "awq" or "fp8"
    bits: int
    number: str = "int"  # "int" or "e4m3"
    symmetric: bool = True
    strategy: str = "channel"  # "tensor", "channel", "group" or "block"
    group_size: int | None = None  # inputs a group ("group"); block columns ("block")
    block_rows: int | None = None  # outputs a block ("block")
    actorder: bool = False  # groups in an order of their own: a g_idx tensor
    activations: Activations | None = None  # int8 activations (W8A8)
    fp8_activations: bool = False  # fp8 activations (computed weight-only on a CPU)
    zero_minus_one: bool = False  # GPTQ v1 stores each zero point minus one

    @property
    def w8a8(self) -> bool:
        return self.activations is not None

    def describe(self) -> str:
        if self.w8a8:
            return f"W8A8 int8 (activations {self.activations.describe()})"
        what = f"W{self.bits}A16" if self.number == "int" else "FP8"
        how = {"tensor": "per tensor", "channel": "per channel",
               "block": f"blocks of {self.block_rows}x{self.group_size}",
               "group": f"groups of {self.group_size}"}[self.strategy]  # fmt: skip
        extra = "" if self.symmetric else ", asymmetric"
        if self.fp8_activations:
            extra += ", fp8 activations"
        return f"{what} {how}{extra}"


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantization: its method, its schemes and what they cover."""

    method: str
    groups: tuple[tuple[tuple[str, ...], Scheme], ...]  # (targets, scheme) in order
    ignore: tuple[str, ...] = ()
    by_presence: bool = False  # a module is quantized where its tensors are
    kv_cache_scheme: dict | None = field(default=None, hash=False)
    at_load: bool = False  # a dense checkpoint's projections, quantized at load

    @property
    def rows_apart(self) -> bool:
        """Whether every product computes each row apart from its batch: W8A8's sums
        are exact integers on every kernel (int32 tiles, oneDNN's int32, the
        reference's float64) and its rows' scales their own (per token, or static);
        a weight-only product's float sums follow the batch where the reference's
        torch product runs."""
        return all(s.w8a8 and (s.activations.per_token or not s.activations.dynamic)
                   for _, s in self.groups)  # fmt: skip

    def scheme_for(self, module: str) -> Scheme | None:
        """The scheme of ``module`` (its checkpoint name, ``...self_attn.q_proj``),
        None where it stays dense."""
        if any(_matches(module, pattern) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(module, t) for t in targets):
                return scheme
        return None

    def describe(self) -> str:
        schemes = ", ".join(dict.fromkeys(s.describe() for _, s in self.groups))
        return f"{self.method}{' (quantized at load)' if self.at_load else ''}: {schemes}"


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors' rule: a ``re:`` pattern matched from the start, else the
    exact name (GPTQ's and AWQ's lists name modules by a part of their name)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def parse(raw: dict[str, Any] | None) -> QuantConfig | None:
    """``config.json``'s ``quantization_config``, or None when it has none."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CheckpointError("config.json: 'quantization_config' must be an object")
    method = raw.get("quant_method")
    parsers = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq,
               "fp8": _fp8}  # fmt: skip
    if method not in parsers:
        raise _refuse("quant_method", method, f"served: {', '.join(METHODS)}")
    return parsers[method](raw)


def _int(raw: dict, key: str, where: str, allowed=None, default: Any = ...) -> Any:
    value = raw.get(key, default)
    if value is ...:
        raise CheckpointError(f"config.json: quantization_config.{where}{key} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(f"{where}{key}", value, "it must be an integer")
    if allowed is not None and value not in allowed:
        raise _refuse(f"{where}{key}", value, f"served: {', '.join(map(str, allowed))}")
    return value


def _compressed_tensors(raw: dict) -> QuantConfig:
    for key in ("sparsity_config", "transform_config"):
        if raw.get(key):
            raise _refuse(key, raw[key], "sparse and transformed weights are not served")
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_status", status, "only compressed checkpoints are served")
    config_groups = raw.get("config_groups")
    if not isinstance(config_groups, dict) or not config_groups:
        raise _refuse("config_groups", config_groups, "it must name at least one group")
    default_format = raw.get("format")
    groups = []
    for name, group in config_groups.items():
        where = f"config_groups.{name}."
        if not isinstance(group, dict):
            raise _refuse(f"config_groups.{name}", group, "it must be an object")
        targets = group.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise _refuse(f"{where}targets", targets, "it must be a list of names")
        fmt = group.get("format") or default_format
        groups.append((tuple(targets), _ct_scheme(group, fmt, where)))
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise _refuse("ignore", ignore, "it must be a list of names")
    kv = raw.get("kv_cache_scheme")
    if kv is not None:
        _check_kv_scheme(kv)
    return QuantConfig("compressed-tensors", tuple(groups), tuple(ignore), kv_cache_scheme=kv)


def _ct_scheme(group: dict, fmt: str | None, where: str) -> Scheme:
    if fmt not in CT_FORMATS:
        raise _refuse(f"{where}format" if group.get("format") else "format", fmt,
                      f"served: {', '.join(CT_FORMATS)}")  # fmt: skip
    if group.get("output_activations"):
        raise _refuse(f"{where}output_activations", group["output_activations"],
                      "quantized outputs are not served")  # fmt: skip
    w = group.get("weights")
    if not isinstance(w, dict):
        raise _refuse(f"{where}weights", w, "a group needs its weights' arguments")
    wk = f"{where}weights."
    kind = w.get("type", "int")
    if kind not in ("int", "float"):
        raise _refuse(f"{wk}type", kind, "served: int, float")
    bits = _int(w, "num_bits", wk, (4, 8) if kind == "int" else (8,))
    if w.get("dynamic"):
        raise _refuse(f"{wk}dynamic", w["dynamic"], "weights' scales are stored")
    strategy = w.get("strategy", "tensor")
    if strategy not in ("tensor", "channel", "group", "block"):
        raise _refuse(f"{wk}strategy", strategy, "served: tensor, channel, group, block")
    group_size = block_rows = None
    if strategy == "group":
        group_size = _int(w, "group_size", wk)
        if group_size <= 0:
            raise _refuse(f"{wk}group_size", group_size, "it must be positive")
    if strategy == "block":
        block = w.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and b > 0 for b in block)):  # fmt: skip
            raise _refuse(f"{wk}block_structure", block, "it must be [rows, columns]")
        block_rows, group_size = block
    actorder = w.get("actorder")
    if actorder not in (None, "group", "weight", "static", "dynamic"):
        raise _refuse(f"{wk}actorder", actorder, "served: null, group, weight")
    symmetric = bool(w.get("symmetric", True))
    a = group.get("input_activations")
    activations, fp8_activations = None, False
    if a is not None:
        activations, fp8_activations = _ct_activations(a, f"{where}input_activations.", fmt)
    if fmt == "pack-quantized" and (kind != "int" or activations is not None):
        raise _refuse(f"{where}format", fmt, "packed weights are served with 16-bit activations")
    if fmt == "float-quantized" and kind != "float":
        raise _refuse(f"{wk}type", kind, "float-quantized weights are fp8")
    if fmt != "float-quantized" and kind == "float":
        raise _refuse(f"{wk}type", kind, f"fp8 weights are stored float-quantized, not {fmt}")
    if activations is not None:
        if bits != 8 or strategy not in ("tensor", "channel"):
            raise _refuse(f"{wk}strategy", strategy,
                          "W8A8 int8 is served with 8-bit weights per channel or per tensor")  # fmt: skip
        if not symmetric:
            raise _refuse(f"{wk}symmetric", False, "W8A8 weights must be symmetric")
    if kind == "float" and not symmetric:
        raise _refuse(f"{wk}symmetric", False, "fp8 weights are symmetric")
    return Scheme(
        format=fmt, bits=bits, number="int" if kind == "int" else FP8_KINDS[bits],
        symmetric=symmetric, strategy=strategy, group_size=group_size, block_rows=block_rows,
        actorder=actorder in ("group", "dynamic"), activations=activations,
        fp8_activations=fp8_activations,
    )  # fmt: skip


def _ct_activations(a: dict, where: str, fmt: str) -> tuple[Activations | None, bool]:
    """``(int8 activations, fp8 activations)`` of a group's ``input_activations``."""
    if not isinstance(a, dict):
        raise _refuse(where.rstrip("."), a, "it must be an object or null")
    kind = a.get("type", "int")
    bits = _int(a, "num_bits", where, (8,))
    strategy = a.get("strategy", "tensor")
    dynamic = a.get("dynamic", False)
    if dynamic not in (True, False):
        raise _refuse(f"{where}dynamic", dynamic, "served: true, false")
    if kind == "float":  # fp8 activations: the weights' product on a GPU, weight-only on a CPU
        if strategy not in ("token", "tensor", "group"):
            raise _refuse(f"{where}strategy", strategy, "served: token, tensor, group")
        return None, True
    if kind != "int" or bits != 8:
        raise _refuse(f"{where}type", kind, "served: int (8 bits), float")
    if fmt not in ("int-quantized", "naive-quantized"):
        raise _refuse(f"{where}type", kind, f"int8 activations go with int-quantized, not {fmt}")
    if strategy not in ("token", "tensor") or (not dynamic and strategy != "tensor"):
        raise _refuse(f"{where}strategy", strategy,
                      "served: token (dynamic), tensor (dynamic or static)")  # fmt: skip
    symmetric = bool(a.get("symmetric", True))
    # a static scale and zero point are read from the checkpoint (input_scale)
    return Activations(dynamic=bool(dynamic), per_token=strategy == "token",
                       symmetric=symmetric), False  # fmt: skip


def _check_kv_scheme(kv: Any) -> None:
    if not isinstance(kv, dict):
        raise _refuse("kv_cache_scheme", kv, "it must be an object or null")
    if kv.get("type") != "float" or kv.get("num_bits") != 8 or kv.get("strategy") != "tensor":
        raise _refuse("kv_cache_scheme", kv, "served: fp8 (float, 8 bits) per tensor")


def _gptq(raw: dict) -> QuantConfig:
    bits = _int(raw, "bits", "", (4, 8))
    group_size = _int(raw, "group_size", "", default=-1)
    if group_size == 0 or group_size < -1:
        raise _refuse("group_size", group_size, "it must be positive, or -1 (per channel)")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "served: gptq, gptq_v2")
    ignore = []
    for pattern, override in (raw.get("dynamic") or {}).items():
        if not pattern.startswith("-:") or override not in ({}, None):
            raise _refuse(f"dynamic.{pattern}", override,
                          "per-module schemes are not served (only -: exclusions)")  # fmt: skip
        ignore.append("re:" + pattern[2:])
    if not raw.get("lm_head", False):
        ignore.append("lm_head")
    scheme = Scheme(
        format="gptq", bits=bits, symmetric=bool(raw.get("sym", True)),
        strategy="channel" if group_size == -1 else "group",
        group_size=None if group_size == -1 else group_size, actorder=bool(raw.get("desc_act")),
        zero_minus_one=fmt == "gptq",
    )  # fmt: skip
    return QuantConfig("gptq", ((("Linear",), scheme),), tuple(ignore), by_presence=True)


def _awq(raw: dict) -> QuantConfig:
    bits = _int(raw, "bits", "", (4,), default=raw.get("w_bit", ...))
    group_size = _int(raw, "group_size", "", default=raw.get("q_group_size", ...))
    if group_size <= 0:
        raise _refuse("group_size", group_size, "it must be positive")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", raw.get("version"), "served: gemm")
    if not raw.get("zero_point", True):
        raise _refuse("zero_point", raw["zero_point"], "AWQ GEMM checkpoints have zero points")
    skip = raw.get("modules_to_not_convert") or []
    scheme = Scheme(format="awq", bits=bits, symmetric=False, strategy="group",
                    group_size=group_size)  # fmt: skip
    # AWQ names the modules it leaves alone by a part of their name
    ignore = tuple(f"re:.*{re.escape(m)}" for m in skip) + ("lm_head",)
    return QuantConfig("awq", ((("Linear",), scheme),), ignore, by_presence=True)


def _fp8(raw: dict) -> QuantConfig:
    if raw.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fmt", raw.get("fmt"), "served: e4m3")
    scheme_activations = raw.get("activation_scheme", "dynamic")
    if scheme_activations not in ("dynamic", "static"):
        raise _refuse("activation_scheme", scheme_activations, "served: dynamic, static")
    block = raw.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):  # fmt: skip
        raise _refuse("weight_block_size", block, "it must be [rows, columns]")
    scheme = Scheme(
        format="fp8", bits=8, number="e4m3", strategy="tensor" if block is None else "block",
        group_size=None if block is None else block[1],
        block_rows=None if block is None else block[0], fp8_activations=True,
    )  # fmt: skip
    skip = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or []
    ignore = tuple(f"re:.*{re.escape(m)}" for m in skip) + ("lm_head",)
    return QuantConfig("fp8", ((("Linear",), scheme),), ignore, by_presence=True)


def online_fp8() -> QuantConfig:
    """``quantization: fp8`` on a dense checkpoint: every projection but the LM head
    quantized to e4m3 at load, one scale an output, as vLLM does."""
    scheme = Scheme(format="online", bits=8, number="e4m3", strategy="channel",
                    fp8_activations=True)  # fmt: skip
    return QuantConfig("fp8", ((("Linear",), scheme),), ("lm_head",), at_load=True)
