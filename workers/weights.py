"""Each checkpoint's tensors into the model, this rank's shard of each.

The checkpoints name their tensors as transformers saves them; each family
says which tensor is behind each of the decoder's parameters
(:class:`.architectures.base.WeightNames`), and this module how each parameter
is sharded: q/k/v and gate/up stacked by rows from separate tensors or from
consecutive row ranges of one fused tensor, this rank's heads (columns) of
each part; o_proj and down_proj by their input columns; every expert like the
dense MLP; embeddings, norms, routers and the LM head whole.

Every tensor's full shape is checked before its slice is read: a slice of a
wrongly sized tensor can look right. A family that stores each norm's scale
as ``weight - 1`` (Gemma) gives its offset; the model keeps the scale itself.
A quantized checkpoint's products are read by :mod:`.quant.load` (their
``.weight`` tensors are not read here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .architectures import weight_names
from .config import CheckpointError
from .moe import SparseMoE
from .quant import load as quant_load
from .quant import resolve as resolve_quantization

if TYPE_CHECKING:
    from .architectures.base import WeightNames
    from .checkpoint import Checkpoint
    from .model import Decoder


class _Loader:
    def __init__(self, model: Decoder, ckpt: Checkpoint, names: WeightNames,
                 quantized: set[str] = frozenset()):  # fmt: skip
        self.ckpt, self.tp = ckpt, model.tp
        self.norm_offset = names.norm_offset
        self.quantized = quantized  # tensors the quantized loader reads (workers/quant)

    def put(self, dst: torch.Tensor, name: str, dim: int | None = None,
            span: tuple[int, int | None] = (0, None), full: tuple[int, ...] | None = None,
            ) -> None:  # fmt: skip
        """``dst`` from tensor ``name`` (its ``span`` along ``dim``), whose shape must
        be ``full``: by default ``dst``'s, times the ranks along ``dim``."""
        if name in self.quantized:
            return
        if full is None:
            shape = list(dst.shape)
            if dim is not None:
                shape[dim] *= self.tp.size
            full = tuple(shape)
        if self.ckpt.shape(name) != full:
            raise CheckpointError(
                f"weights: {name} has shape {self.ckpt.shape(name)}, expected {full}"
            )
        src = self.ckpt.get(name, dim, *span) if dim is not None else self.ckpt.get(name)
        with torch.no_grad():
            dst.copy_(src)

    def norm(self, dst: torch.Tensor, name: str) -> None:
        self.put(dst, name)
        if self.norm_offset:
            with torch.no_grad():
                dst.add_(self.norm_offset)

    def stacked(self, dst: torch.Tensor, names: list[str], rows: list[tuple[int, int]]) -> None:
        """Row segments of ``dst`` (``(rows per rank, rows in all)`` each, this rank's
        span of each) from one tensor per segment (``names``), or from consecutive
        row ranges of one fused tensor (one name for them all)."""
        fused = len(names) == 1
        at, offset = 0, 0
        total = sum(whole for _, whole in rows)
        for i, (per_rank, whole) in enumerate(rows):
            lo, hi = self.tp.rows(per_rank)
            part = dst[at : at + per_rank]
            if fused:
                full = (total, *dst.shape[1:])
                self.put(part, names[0], 0, (offset + lo, offset + hi), full)
            else:
                self.put(part, names[i], 0, (lo, hi))
            at, offset = at + per_rank, offset + whole


def load_weights(model: Decoder, ckpt: Checkpoint, quantization: str | None = None) -> None:
    """``quantization``: the engine's ``quantization`` (None: the checkpoint's own);
    quantized products are read by :mod:`.quant.load`, the rest here."""
    config = resolve_quantization(quantization, ckpt.quantization)
    quantized = []
    if config is not None and config is ckpt.quantization:
        quantized = quant_load.sites(model, config, ckpt)
    c, tp, n = model.config, model.tp, weight_names(model.config)
    hd, load = c.head_dim, _Loader(model, ckpt, n, quant_load.claims(quantized))
    load.put(model.embed, f"{n.embed}.weight")
    load.norm(model.norm, f"{n.final_norm}.weight")
    if not c.tie_word_embeddings:
        load.put(model.lm_head, f"{n.lm_head}.weight")
    q_rows, kv_rows = tp.num_heads * hd, tp.num_kv_heads * hd
    qkv_rows = [(q_rows, c.num_heads * hd), (kv_rows, c.num_kv_heads * hd),
                (kv_rows, c.num_kv_heads * hd)]  # fmt: skip
    for i, layer in enumerate(model.layers):
        p = n.layer.format(i)
        a = layer.attn
        load.norm(layer.input_norm, f"{p}{n.input_norm}.weight")
        load.norm(layer.post_attn_norm, f"{p}{n.post_attn_norm}.weight")
        if layer.pre_mlp_norm is not None:
            load.norm(layer.pre_mlp_norm, f"{p}{n.pre_mlp_norm}.weight")
            load.norm(layer.post_mlp_norm, f"{p}{n.post_mlp_norm}.weight")
        for suffix, stacked in (("weight", a.qkv_weight), ("bias", a.qkv_bias)):
            if stacked is not None:  # q rows, then k rows, then v rows
                load.stacked(stacked, [f"{p}{t}.{suffix}" for t in n.qkv], qkv_rows)
        load.put(a.o_weight, f"{p}{n.o}.weight", 1, tp.rows(q_rows))
        if a.o_bias is not None:
            load.put(a.o_bias, f"{p}{n.o}.bias")
        if a.q_norm is not None:
            load.norm(a.q_norm, f"{p}{n.q_norm}.weight")
            load.norm(a.k_norm, f"{p}{n.k_norm}.weight")
        if isinstance(layer.mlp, SparseMoE):
            _load_experts(load, layer.mlp, p, n, tp.expert_intermediate)
        else:
            _load_mlp(load, layer.mlp, p, n, tp.intermediate, c.intermediate_size)
    if quantized:
        quant_load.load(model, ckpt, config, quantized)
    elif config is not None:  # fp8 on a dense checkpoint
        quant_load.quantize_online(model, config)


def _load_mlp(load: _Loader, m, p: str, n: WeightNames, inter: int, whole: int) -> None:
    for suffix, stacked in (("weight", m.gate_up_weight), ("bias", m.gate_up_bias)):
        if stacked is not None:  # gate rows, then up rows
            load.stacked(stacked, [f"{p}{t}.{suffix}" for t in n.gate_up], [(inter, whole)] * 2)
    load.put(m.down_weight, f"{p}{n.down}.weight", 1, load.tp.rows(inter))
    if m.down_bias is not None:
        load.put(m.down_bias, f"{p}{n.down}.bias")


def _load_experts(load: _Loader, moe: SparseMoE, p: str, n: WeightNames, inter: int) -> None:
    gate, up, down = n.expert_gate_up_down
    load.put(moe.router, f"{p}{n.router}.weight")
    rows = load.tp.rows(inter)
    for e in range(moe.w13.shape[0]):
        x = p + n.expert.format(e)
        load.put(moe.w13[e, :inter], f"{x}{gate}.weight", 0, rows)
        load.put(moe.w13[e, inter:], f"{x}{up}.weight", 0, rows)
        load.put(moe.w2[e], f"{x}{down}.weight", 1, rows)
