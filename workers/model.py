"""The decoder every supported architecture shares, over a flat token batch.

Llama 2/3, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 2/3 and Phi-3 are one
decoder (:class:`Decoder`) built from :class:`ModelConfig`: the model's shape
and ends (scaled embeddings, tied or soft-capped LM head, a partial rotary
embedding, a second rope table for local layers), and each layer as its
:class:`LayerSpec` says (norm placement, q/k norms, biases, window, soft cap,
a dense MLP or a mixture of experts, :mod:`.moe`). The attention and the dense
MLP are in :mod:`.layers`; what each architecture reads from its config and how
it names its tensors is its family's business (:mod:`.architectures`).

Every step computes one flat batch: the tokens of all scheduled sequences laid
end to end, ``[num_tokens, ...]``, whatever mix of decodes and prefill pieces
it holds; per-sequence structure lives only in the step's
:class:`~iterserve.kernels.AttentionMetadata`.

Tensor parallelism (Megatron layout): q/k/v and gate/up are split by output
(column-parallel, whole heads per rank; every expert likewise), o_proj and
down_proj by input (row-parallel) and each is followed by one all-reduce.
Embeddings, norms, routers and the LM head are replicated, so every rank ends
with the same full logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import AttentionMetadata, build_cos_sin_cache
from ..kernels.cpu.linear import PackedWeight, linear, packs_every_batch
from ..kernels.cpu.linear import pack as pack_weight
from ..kernels.rope import uses_long_factors
from .config import MOE, SANDWICH, LayerSpec, ModelConfig
from .kv_cache import KVCache
from .layers import (
    MLP,
    AllReduce,
    Attention,
    TPLayout,
    identity,
    weight,
)
from .moe import SparseMoE

if TYPE_CHECKING:  # reading checkpoints needs safetensors; building a model does not
    from .checkpoint import Checkpoint
    from .lora_batch import LoraContext

__all__ = [
    "AllReduce",
    "Decoder",
    "DecoderLayer",
    "rope_table",
    "weight_bytes",
]


def served_context(config: ModelConfig, max_model_len: int | None) -> int:
    """``max_model_len``, or the checkpoint's when None or past it."""
    return min(max_model_len or config.max_model_len, config.max_model_len)


def rope_table(config: ModelConfig, max_model_len: int | None = None) -> torch.Tensor:
    """The fp32 rotary table (``[positions, rope_dim]``) of ``config``'s global layers
    for an engine that serves ``max_model_len`` tokens (None: the checkpoint's
    ``max_model_len``). Every rank and the draft model build theirs with this.

    A ``longrope`` model takes its long factors when ``max_model_len`` exceeds its
    ``original_max_position_embeddings`` (vLLM's rule, see
    :mod:`iterserve.kernels.rope`), and its table covers ``max_position_embeddings``;
    otherwise it takes its short factors, which are transformers' numbers only within
    the original context, and its table covers no more (positions past it are
    refused, not computed wrongly). Every other model's table covers
    ``max_position_embeddings``."""
    context = served_context(config, max_model_len)
    rows = config.max_position_embeddings
    scaling = config.rope_scaling
    longrope = scaling is not None and scaling["rope_type"] == "longrope"
    if longrope and not uses_long_factors(scaling, context):
        rows = min(rows, scaling["original_max_position_embeddings"])
    return build_cos_sin_cache(config.rope_dim, rows, config.rope_theta, scaling,
                               max_model_len=context)  # fmt: skip


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec, tp: TPLayout, ops: Any,
                 all_reduce: AllReduce, **kw):  # fmt: skip
        super().__init__()
        self.ops, self.eps = ops, config.rms_norm_eps
        h = config.hidden_size
        self.input_norm = weight(h, **kw)
        self.post_attn_norm = weight(h, **kw)
        # Sandwich norms normalise each sublayer's output too, before the residual add;
        # the MLP then gets a norm of its own (pre_mlp_norm) in place of post_attn_norm's.
        sandwich = spec.norms == SANDWICH
        self.pre_mlp_norm = weight(h, **kw) if sandwich else None
        self.post_mlp_norm = weight(h, **kw) if sandwich else None
        self.attn = Attention(config, spec, tp, ops, all_reduce, **kw)
        if spec.mlp == MOE:
            self.mlp: nn.Module = SparseMoE(config, spec, tp, ops, all_reduce, **kw)
        else:
            self.mlp = MLP(config, spec, tp, ops, all_reduce, **kw)

    def forward(self, hidden, residual, attn: AttentionMetadata):
        """``(hidden, residual)`` in and out: the norms fuse the residual adds."""
        norm, eps = self.ops.rms_norm, self.eps
        if residual is None:
            residual, hidden = hidden, norm(hidden, self.input_norm, eps)
        else:
            hidden, residual = norm(hidden, self.input_norm, eps, residual)
        hidden = self.attn(hidden, attn)
        if self.pre_mlp_norm is None:
            hidden, residual = norm(hidden, self.post_attn_norm, eps, residual)
            return self.mlp(hidden), residual
        hidden = norm(hidden, self.post_attn_norm, eps)
        hidden, residual = norm(hidden, self.pre_mlp_norm, eps, residual)
        return norm(self.mlp(hidden), self.post_mlp_norm, eps), residual


class Decoder(nn.Module):
    """Decoder stack plus LM head; ``forward`` returns logits for selected rows only
    (their final hidden states instead with ``returns_hidden``: a pooling runner's)."""

    returns_hidden = False

    def __init__(
        self,
        config: ModelConfig,
        ops: Any,
        cos_sin: torch.Tensor,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce | None = None,
        max_model_len: int | None = None,
    ):
        """``cos_sin``: the global layers' table (:func:`rope_table`); ``max_model_len``:
        the context served, which picks the local layers' longrope factors likewise."""
        super().__init__()
        self.config, self.ops = config, ops
        self.tp = TPLayout(config, tp_rank, tp_size)
        if tp_size > 1 and all_reduce is None:
            raise ValueError("tp_size > 1 needs an all_reduce callable")
        reduce = all_reduce if tp_size > 1 else identity
        kw = {"dtype": dtype, "device": device}
        self.embed = weight(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, self.tp, ops, reduce, **kw) for spec in config.layers
        )
        self.norm = weight(config.hidden_size, **kw)
        self.lm_head = (
            self.embed
            if config.tie_word_embeddings
            else weight(config.vocab_size, config.hidden_size, **kw)
        )
        self.register_buffer("cos_sin", cos_sin.to(device=device), persistent=False)
        local = None
        if config.local_rope_theta is not None and cos_sin.shape[0]:  # fp32, as the global one
            local = build_cos_sin_cache(config.rope_dim, cos_sin.shape[0], config.local_rope_theta,
                                        config.local_rope_scaling,
                                        max_model_len=served_context(config, max_model_len),
                                        ).to(device=device)  # fmt: skip
        self.register_buffer("cos_sin_local", local, persistent=False)
        # Scaled by sqrt(hidden) (Gemma), rounded to the weights' dtype as Gemma does.
        self.embed_scale = None
        if config.scale_embeddings:
            self.embed_scale = torch.tensor(config.hidden_size**0.5).to(device=device, dtype=dtype)
        self.lm_head_packed: PackedWeight | None = None
        # the sliding windows the layers attend within: a step's plan makes each
        # row's start under each once
        self.windows = {layer.attn.window for layer in self.layers} - {None}
        self.block_size = 0  # the KV cache's, once bound (bind_kv_cache)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits], rows of the flat batch
    ) -> torch.Tensor:
        """Logits of the ``logits_indices`` rows; the layers are bound to a KV cache
        (:meth:`bind_kv_cache`)."""
        c = self.config
        if attn.host is None:  # what the kernels read of the step, made once for every layer
            attn.host = self.ops.prepare(attn, num_heads=self.tp.num_heads,
                                         block_size=self.block_size, windows=self.windows)  # fmt: skip
        hidden = F.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, attn)
        # Only rows whose logits are wanted need the final norm and the (large)
        # vocabulary projection; both are row-wise, so gathering first is exact.
        hidden = hidden[logits_indices]  # [num_logits, hidden]
        if residual is None:
            hidden = self.ops.rms_norm(hidden, self.norm, c.rms_norm_eps)
        else:
            hidden, _ = self.ops.rms_norm(hidden, self.norm, c.rms_norm_eps,
                                          residual[logits_indices])  # fmt: skip
        if self.returns_hidden:  # after the last norm: transformers' last_hidden_state
            return hidden
        logits = linear(hidden, self.lm_head, None, self.lm_head_packed)  # [num_logits, vocab]
        if c.final_softcap is not None:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    def bind_kv_cache(self, kv: KVCache) -> None:
        """Binds every attention layer to its cache in ``kv`` and its rotary table
        (the local one on sliding layers that have their own): the kernels' view of
        both is made now, not in a step."""
        for i, layer in enumerate(self.layers):
            cos_sin = self.cos_sin_local if layer.attn.local_rope else self.cos_sin
            layer.attn.bind(cos_sin, kv.keys[i], kv.values[i])
        self.block_size = kv.block_size

    def pack_weights(self, pads_cliff=None, invariant: bool = False) -> bool:
        """Keeps every matrix product's weight in oneDNN's layout
        (:mod:`iterserve.kernels.cpu.linear`); call after the weights are loaded.
        ``pads_cliff(shape)``: the engine's choice of the weights whose 17–32-row bf16
        batches run as 33 rows (None: none); ``invariant``: a batch-invariant engine's
        products (:mod:`iterserve.kernels.cpu.fixed_rows`).
        fp32 keeps the plain weight too, for batches under 16 rows; bf16 products
        all take the packed one, so its plain weights are let go (but the embedding,
        which the first layer reads by row, and the experts'). False (nothing packed)
        where it does not apply: not fp32 or bf16 on the CPU, or no oneDNN here."""
        pads = pads_cliff or (lambda shape: False)
        for layer in self.layers:
            a = layer.attn
            a.qkv_packed = pack_weight(a.qkv_weight, pads(a.qkv_weight.shape), invariant)
            a.o_packed = pack_weight(a.o_weight, pads(a.o_weight.shape), invariant)
            layer.mlp.pack(pads, invariant)
        self.lm_head_packed = pack_weight(self.lm_head, pads(self.lm_head.shape), invariant)
        if self.lm_head_packed is None:
            return False
        if packs_every_batch(self.embed.dtype):
            # Experts keep theirs: the expert kernels index them by expert.
            for layer in self.layers:
                plain = [layer.attn.qkv_weight, layer.attn.o_weight]
                if isinstance(layer.mlp, MLP):
                    plain += [layer.mlp.gate_up_weight, layer.mlp.down_weight]
                for param in plain:
                    param.data = param.data.new_empty(0)
            if self.lm_head is not self.embed:
                self.lm_head.data = self.lm_head.data.new_empty(0)
        return True

    def enable_lora(self) -> LoraContext:
        """Gives every attention and dense MLP a LoRA site reading one shared
        context, which the runner points at each step's adapters (:mod:`.lora`)."""
        from .lora_batch import LoraContext, LoraSite

        context = LoraContext()
        for i, layer in enumerate(self.layers):
            layer.attn.lora = LoraSite(context, i)
            if isinstance(layer.mlp, MLP):
                layer.mlp.lora = LoraSite(context, i)
        return context

    def set_ops(self, ops: Any, kv: KVCache) -> None:
        """Runs the same weights on another kernel backend (for comparisons), its
        layers bound to ``kv``."""
        self.ops = ops
        for layer in self.layers:
            layer.ops = layer.attn.ops = layer.mlp.ops = ops
        self.bind_kv_cache(kv)

    @torch.no_grad()
    def init_random_(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (norms at 1), drawn on the weights' device: benchmarks and
        device checks need a model of a real shape, not a checkpoint."""
        gen = torch.Generator(device=self.embed.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)

    def load_weights(self, ckpt: Checkpoint, quantization: str | None = None) -> None:
        """Copies this rank's shard of every tensor of the checkpoint into place;
        ``quantization``: the engine's (None: the checkpoint's own, :mod:`.quant`)."""
        from .weights import load_weights

        load_weights(self, ckpt, quantization)


def weight_bytes(
    config: ModelConfig, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1
) -> int:
    """Bytes of one rank's weights: the model built on the meta device, so the
    count follows the model's own definition and allocates nothing."""
    model = Decoder(
        config,
        None,
        torch.empty(0, config.rope_dim),
        dtype=dtype,
        device="meta",
        tp_rank=tp_rank,
        tp_size=tp_size,
        all_reduce=identity,
    )
    # The tied LM head is the embedding itself: parameters() yields it once.
    return sum(p.numel() * p.element_size() for p in model.parameters())
