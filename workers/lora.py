"""LoRA adapters on a rank: PEFT checkpoints read and checked against the base
model, held in adapter slots, and added to the products of a mixed batch.

An adapter as ``peft`` saves it is a directory with ``adapter_config.json`` and
``adapter_model.safetensors``: for each adapted projection ``W`` (``[out, in]``)
of each layer, ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``), so that
the projection computes ``x W^T + s (x A^T) B^T`` with ``s = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA). Targets are the attention's
``q/k/v/o_proj`` and the dense MLP's ``gate/up/down_proj``.

The decoder fuses q, k and v into one product, and gate and up into another;
an adapter is laid out the same way, per layer and product (``qkv``, ``o``,
``gate_up``, ``down``), with ``s`` folded into B::

    At = [A_q; A_k; A_v]^T              [in, r_q + r_k + r_v]
    Bt = | B_q^T   0      0    |        [r_q + r_k + r_v, q + 2 kv]
         |  0     B_k^T   0    |
         |  0      0     B_v^T |

so one shrink ``x At`` and one expand ``(x At) Bt`` add every target's delta.
Tensor parallelism slices B's rows where the product is split by output (q, k,
v, gate, up) and A's columns where it is split by input (o, down): there each
rank's ``(x_r A_r^T) B^T`` is a partial sum, which the layer's all-reduce adds
up with the base product's, so adapters cost no communication.

How a step's rows use the adapters held in the rank's slots is
:mod:`.lora_batch`'s business.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import MOE, ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Each target's product on the rank, and its place in that product's fused output.
GROUPS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
          "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}  # fmt: skip
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(TARGETS) + r")\.lora_([AB])"
    r"(?:\.[A-Za-z0-9_-]+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the problem."""


@dataclass
class PeftAdapter:
    """An adapter as read from its checkpoint: full (unsharded) fp32 tensors,
    ``weights[(layer, target)] = (A [r, in], B [out, r])``, B not yet scaled."""

    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def targets(self) -> list[str]:
        return sorted({t for _, t in self.weights}, key=TARGETS.index)


def target_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """``(out, in)`` of a target projection of the whole (unsharded) model."""
    h, q, kv = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
    )
    inter = config.intermediate_size
    return {
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
        "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter),
    }[target]  # fmt: skip


def _read_config(path: Path, max_rank: int) -> tuple[int, float, Any]:
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise AdapterError(f"adapter path {path} is not a directory")
    if not file.is_file():
        raise AdapterError(f"adapter path {path} has no {CONFIG_FILE}")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    rank = cfg.get("r")
    if type(rank) is not int or rank < 1:
        raise AdapterError(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"rank r={rank} is over max_lora_rank {max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    for key, refused in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out")):
        if cfg.get(key):
            raise AdapterError(f"{key}: {refused} adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"bias {cfg.get('bias')!r} is not supported (only 'none')")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layer_replication"):
        if cfg.get(key):
            raise AdapterError(f"{key} is not supported: {cfg[key]!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise AdapterError(
                f"unknown target modules {unknown} (supported: {', '.join(TARGETS)})"
            )
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scaling), cfg


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> PeftAdapter:
    """Reads and checks a PEFT LoRA checkpoint against ``config``; raises
    :class:`AdapterError` naming the first problem (a missing file, a rank over
    ``max_rank``, an unknown target module, a shape that does not match the base
    model, a layer the model lacks or whose MLP is a mixture of experts)."""
    from safetensors import safe_open

    path = Path(path)
    rank, scaling, _ = _read_config(path, max_rank)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        bin_file = path / "adapter_model.bin"
        hint = (
            " (adapter_model.bin is not read: save with safe_serialization)"
            if bin_file.exists()
            else ""
        )
        raise AdapterError(f"adapter path {path} has no {WEIGHTS_FILE}{hint}")
    adapter = PeftAdapter(str(path), rank, scaling)
    # Shapes are checked from the header before any tensor is read: a file of
    # another model (or an absurd one) costs no memory.
    keys: dict[tuple[int, str], dict[str, str]] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = _KEY.search(key)
                if m is None:
                    raise AdapterError(
                        f"tensor {key!r} is not a LoRA weight of a supported target "
                        f"({', '.join(TARGETS)})"
                    )
                layer, target, half = int(m.group(1)), m.group(2), m.group(3)
                keys.setdefault((layer, target), {})[half] = key
            if not keys:
                raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
            for (layer, target), pair in sorted(keys.items()):
                _check_pair(config, rank, layer, target, pair,
                            {h: tuple(f.get_slice(k).get_shape()) for h, k in pair.items()})  # fmt: skip
            for (layer, target), pair in keys.items():
                a, b = (f.get_tensor(pair[h]).float() for h in "AB")
                adapter.weights[(layer, target)] = (a, b)
    except AdapterError:
        raise
    except Exception as exc:  # a truncated or foreign file
        raise AdapterError(f"{WEIGHTS_FILE} is not readable: {exc}") from None
    return adapter


def _check_pair(config: ModelConfig, rank: int, layer: int, target: str, pair: dict,
                shapes: dict[str, tuple[int, ...]]) -> None:  # fmt: skip
    where = f"layer {layer} {target}"
    if layer >= config.num_layers:
        raise AdapterError(f"{where}: the base model has {config.num_layers} layers")
    if GROUPS[target] in ("gate_up", "down") and config.layers[layer].mlp == MOE:
        raise AdapterError(f"{where}: the base model's MLP there is a mixture of experts")
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{where}: lora_{'AB'.replace(''.join(pair), '')} is missing")
    out_dim, in_dim = target_shape(config, target)
    if shapes["A"] != (rank, in_dim) or shapes["B"] != (out_dim, rank):
        raise AdapterError(
            f"{where}: lora_A {shapes['A']} and lora_B {shapes['B']} do not match "
            f"the base model's projection ({out_dim} x {in_dim}) at rank {rank}"
        )


def check_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> dict:
    """What :func:`read_adapter` checks, for the engine before it registers an
    adapter; returns a summary (rank, targets)."""
    adapter = read_adapter(path, config, max_rank)
    return {"rank": adapter.rank, "targets": adapter.targets}


# -- on the rank -----------------------------------------------------------------------


@dataclass
class LoraProduct:
    """One adapter's delta for one fused product of one layer on this rank (or,
    batched, several adapters': a leading ``[A]`` dimension)."""

    at: torch.Tensor  # [in_local, R], A stacked by target, transposed
    bt: torch.Tensor  # [R, out_local], B block-diagonal by target, scaled, transposed


def _slices(config: ModelConfig, tp_rank: int, tp_size: int) -> dict[str, tuple[int, int, int]]:
    """Per target: the rows of the whole B (output split) or columns of the whole A
    (input split) this rank owns, as ``(start, end, offset in the fused output)``."""
    hd = config.head_dim
    q, kv = config.num_heads * hd // tp_size, config.num_kv_heads * hd // tp_size
    inter = config.intermediate_size // tp_size
    r = tp_rank
    return {
        "q_proj": (r * q, (r + 1) * q, 0),
        "k_proj": (r * kv, (r + 1) * kv, q),
        "v_proj": (r * kv, (r + 1) * kv, q + kv),
        "o_proj": (r * q, (r + 1) * q, 0),
        "gate_proj": (r * inter, (r + 1) * inter, 0),
        "up_proj": (r * inter, (r + 1) * inter, inter),
        "down_proj": (r * inter, (r + 1) * inter, 0),
    }


def _widths(config: ModelConfig, tp_size: int) -> dict[str, int]:
    """Each fused product's output width on a rank."""
    hd = config.head_dim
    q, kv = config.num_heads * hd // tp_size, config.num_kv_heads * hd // tp_size
    inter = config.intermediate_size // tp_size
    return {"qkv": q + 2 * kv, "o": config.hidden_size, "gate_up": 2 * inter,
            "down": config.hidden_size}  # fmt: skip


def group_columns(config: ModelConfig, tp_size: int) -> dict[str, list[int]]:
    """Per fused product, the bounds of each of its targets' output columns on a
    rank, in :data:`TARGETS` order (``[0, q, q + kv, q + 2 kv]`` for ``qkv``)."""
    out: dict[str, list[int]] = {}
    for target, (start, end, offset) in _slices(config, 0, tp_size).items():
        group = GROUPS[target]
        if group in ("o", "down"):  # split by input: the whole output
            out[group] = [0, _widths(config, tp_size)[group]]
        else:
            out.setdefault(group, [0]).append(offset + end - start)
    return out


def target_parts(adapter: PeftAdapter, config: ModelConfig, *, tp_rank: int,
                 tp_size: int) -> list[dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]]]:  # fmt: skip
    """Per layer and fused product, this rank's ``(target, A [r, in_local], B^T
    [r, its columns])`` of each target the adapter has, in :data:`TARGETS` order,
    B scaled; zeros in a layer the adapter leaves alone (every layer then has the
    same products and targets, so a product's shape is the adapter's in every
    layer). fp32, on the host."""
    slices = _slices(config, tp_rank, tp_size)
    hd = config.head_dim
    in_dims = {"qkv": config.hidden_size, "o": config.num_heads * hd,
               "gate_up": config.hidden_size, "down": config.intermediate_size}  # fmt: skip
    present = {t for _, t in adapter.weights}
    out: list[dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]]] = [
        {} for _ in range(config.num_layers)
    ]
    for layer in range(config.num_layers):
        for target in TARGETS:
            if target not in present:
                continue
            group = GROUPS[target]
            if (layer, target) in adapter.weights:
                a, b = adapter.weights[(layer, target)]
                b = b * adapter.scaling
            else:
                a = torch.zeros(adapter.rank, in_dims[group])
                b = torch.zeros(target_shape(config, target)[0], adapter.rank)
            start, end, _ = slices[target]
            if group in ("o", "down"):  # split by input: A's columns are this rank's
                part = (target, a[:, start:end], b.t())
            else:  # split by output: B's rows are this rank's
                part = (target, a, b[start:end].t())
            out[layer].setdefault(group, []).append(part)
    return out


def shard_adapter(adapter: PeftAdapter, config: ModelConfig, *, tp_rank: int, tp_size: int,
                  dtype: torch.dtype, device: Any) -> list[dict[str, LoraProduct]]:  # fmt: skip
    """Per layer, this rank's :class:`LoraProduct` of each fused product the
    adapter touches (see the module docstring)."""
    widths = _widths(config, tp_size)
    offsets = {t: offset for t, (_, _, offset) in _slices(config, tp_rank, tp_size).items()}
    out: list[dict[str, LoraProduct]] = [{} for _ in range(config.num_layers)]
    for layer, groups in enumerate(target_parts(adapter, config, tp_rank=tp_rank,
                                                tp_size=tp_size)):  # fmt: skip
        for group, parts in groups.items():
            ats, bts = [], []
            for target, a, bt in parts:
                ats.append(a)
                if group in ("o", "down"):
                    bts.append(bt)
                else:  # at the target's offset in the fused output
                    wide = torch.zeros(a.shape[0], widths[group])
                    wide[:, offsets[target] : offsets[target] + bt.shape[1]] = bt
                    bts.append(wide)
            at = torch.cat(ats, dim=0).t()  # [in_local, R]
            bt = torch.cat(bts, dim=0)  # [R, out_local]
            out[layer][group] = LoraProduct(
                at.to(dtype=dtype, device=device).contiguous(),
                bt.to(dtype=dtype, device=device).contiguous(),
            )
    return out
