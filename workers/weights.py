"""Each checkpoint's tensors into the model, this rank's shard of each.

The checkpoints name their tensors as transformers saves them::

    model.embed_tokens / model.norm / lm_head (unless tied)
    layers.i.input_layernorm, post_attention_layernorm
             pre_feedforward_layernorm, post_feedforward_layernorm    Gemma
    layers.i.self_attn.{q,k,v,o}_proj (+ .bias), {q,k}_norm           Qwen3, Gemma 3
             self_attn.qkv_proj                                       Phi-3, fused
    layers.i.mlp.{gate,up,down}_proj                                  dense
             mlp.gate_up_proj                                         Phi-3, fused
             mlp.gate + mlp.experts.j.{gate,up,down}_proj             Qwen3-MoE
             block_sparse_moe.gate + .experts.j.{w1,w3,w2}            Mixtral

Every tensor's full shape is checked before its slice is read: a slice of a
wrongly sized tensor can look right. Gemma stores each norm's scale as
``weight - 1``; the model keeps the scale itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .config import CheckpointError
from .moe import SparseMoE

if TYPE_CHECKING:
    from .checkpoint import Checkpoint
    from .model import Decoder

FUSED = {"Phi3ForCausalLM"}
EXPERT_NAMES = {  # architecture -> (block, router, gate, up, down)
    "MixtralForCausalLM": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
    "Qwen3MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
}
NORM_OFFSET = {"Gemma2ForCausalLM": 1.0, "Gemma3ForCausalLM": 1.0}  # norms stored as scale - 1


class _Loader:
    def __init__(self, model: Decoder, ckpt: Checkpoint):
        self.ckpt, self.tp = ckpt, model.tp
        self.norm_offset = NORM_OFFSET.get(model.config.architecture, 0.0)

    def put(self, dst: torch.Tensor, name: str, dim: int | None = None,
            span: tuple[int, int | None] = (0, None), full: tuple[int, ...] | None = None,
            ) -> None:  # fmt: skip
        """``dst`` from tensor ``name`` (its ``span`` along ``dim``), whose shape must
        be ``full``: by default ``dst``'s, times the ranks along ``dim``."""
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

    def stacked(self, dst: torch.Tensor, parts: list[tuple[str, int, int]], name: str,
                fused: bool) -> None:  # fmt: skip
        """Row segments of ``dst`` (``(suffix, rows per rank, rows in all)`` each, this
        rank's span of each) from one tensor per segment, or from consecutive row
        ranges of one fused tensor ``name``."""
        at, offset = 0, 0
        total = sum(whole for _, _, whole in parts)
        for suffix, per_rank, whole in parts:
            lo, hi = self.tp.rows(per_rank)
            part = dst[at : at + per_rank]
            if fused:
                full = (total, *dst.shape[1:])
                self.put(part, f"{name}.{suffix}", 0, (offset + lo, offset + hi), full)
            else:
                self.put(part, f"{name}.{suffix}", 0, (lo, hi))
            at, offset = at + per_rank, offset + whole


def load_weights(model: Decoder, ckpt: Checkpoint) -> None:
    c, tp = model.config, model.tp
    hd, load = c.head_dim, _Loader(model, ckpt)
    fused = c.architecture in FUSED
    load.put(model.embed, "model.embed_tokens.weight")
    load.norm(model.norm, "model.norm.weight")
    if not c.tie_word_embeddings:
        load.put(model.lm_head, "lm_head.weight")
    q_rows, kv_rows = tp.num_heads * hd, tp.num_kv_heads * hd
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = layer.attn
        load.norm(layer.input_norm, p + "input_layernorm.weight")
        load.norm(layer.post_attn_norm, p + "post_attention_layernorm.weight")
        if layer.pre_mlp_norm is not None:
            load.norm(layer.pre_mlp_norm, p + "pre_feedforward_layernorm.weight")
            load.norm(layer.post_mlp_norm, p + "post_feedforward_layernorm.weight")
        for suffix, stacked in (("weight", a.qkv_weight), ("bias", a.qkv_bias)):
            if stacked is None:
                continue
            segments = [(f"q_proj.{suffix}", q_rows, c.num_heads * hd),
                        (f"k_proj.{suffix}", kv_rows, c.num_kv_heads * hd),
                        (f"v_proj.{suffix}", kv_rows, c.num_kv_heads * hd)]  # fmt: skip
            if fused:  # one qkv_proj tensor: q rows, then k rows, then v rows
                segments = [(suffix, rows, whole) for _, rows, whole in segments]
            load.stacked(stacked, segments, p + ("self_attn.qkv_proj" if fused else "self_attn"),
                         fused)  # fmt: skip
        load.put(a.o_weight, p + "self_attn.o_proj.weight", 1, tp.rows(q_rows))
        if a.o_bias is not None:
            load.put(a.o_bias, p + "self_attn.o_proj.bias")
        if a.q_norm is not None:
            load.norm(a.q_norm, p + "self_attn.q_norm.weight")
            load.norm(a.k_norm, p + "self_attn.k_norm.weight")
        if isinstance(layer.mlp, SparseMoE):
            _load_experts(load, layer.mlp, p, c.architecture, tp.expert_intermediate)
        else:
            _load_mlp(load, layer.mlp, p, fused, tp.intermediate, c.intermediate_size)


def _load_mlp(load: _Loader, m, p: str, fused: bool, inter: int, whole: int) -> None:
    for suffix, stacked in (("weight", m.gate_up_weight), ("bias", m.gate_up_bias)):
        if stacked is None:
            continue
        if fused:  # one gate_up_proj tensor: gate rows, then up rows
            segments = [(suffix, inter, whole), (suffix, inter, whole)]
            load.stacked(stacked, segments, p + "mlp.gate_up_proj", True)
        else:
            segments = [(f"gate_proj.{suffix}", inter, whole), (f"up_proj.{suffix}", inter, whole)]
            load.stacked(stacked, segments, p + "mlp", False)
    load.put(m.down_weight, p + "mlp.down_proj.weight", 1, load.tp.rows(inter))
    if m.down_bias is not None:
        load.put(m.down_bias, p + "mlp.down_proj.bias")


def _load_experts(load: _Loader, moe, p: str, architecture: str, inter: int) -> None:
    block, router, gate, up, down = EXPERT_NAMES[architecture]
    load.put(moe.router, f"{p}{block}.{router}.weight")
    rows = load.tp.rows(inter)
    for e in range(moe.w13.shape[0]):
        x = f"{p}{block}.experts.{e}."
        load.put(moe.w13[e, :inter], f"{x}{gate}.weight", 0, rows)
        load.put(moe.w13[e, inter:], f"{x}{up}.weight", 0, rows)
        load.put(moe.w2[e], f"{x}{down}.weight", 1, rows)
