"""The decoder every supported architecture shares, over a flat token batch.

Llama 2/3, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 2/3 and Phi-3 are one
pre-norm decoder with options read from the config (:class:`ModelConfig`):
biases, q/k norms, Gemma's extra norms, scaled embeddings and soft-caps,
sliding-window layers with their own rope base, a partial rotary embedding,
and a mixture of experts in place of the MLP (:mod:`.moe`). How each
checkpoint names its tensors is :mod:`.weights`'s business.

Every step computes one flat batch: the tokens of all scheduled sequences laid
end to end, ``[num_tokens, ...]``, whatever mix of decodes and prefill pieces
it holds; per-sequence structure lives only in :class:`AttentionInputs`.

Tensor parallelism (Megatron layout): q/k/v and gate/up are split by output
(column-parallel, whole heads per rank; every expert likewise), o_proj and
down_proj by input (row-parallel) and each is followed by one all-reduce.
Embeddings, norms, routers and the LM head are replicated, so every rank ends
with the same full logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.kernels import build_cos_sin_cache
from iterserve.kernels.cpu_linear import linear
from iterserve.kernels.cpu_linear import pack as pack_weight
from iterserve.workers.config import ModelConfig
from iterserve.workers.kv_cache import KVCache

if TYPE_CHECKING:  # reading checkpoints needs safetensors; building a model does not
    from iterserve.workers.checkpoint import Checkpoint

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass
class AttentionInputs:
    """How the flat batch splits into sequences, for ``store_kv``/``paged_attention``."""

    slot_mapping: torch.Tensor  # [num_tokens], block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs], KV length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    # Host-side bounds the attention kernels choose their launches by (no sync):
    # the longest query piece and the longest sequence; None = infer from shapes.
    max_query_len: int | None = None
    max_seq_len: int | None = None


def weight(*shape: int, dtype: torch.dtype, device: Any) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class TPLayout:
    """Which heads / MLP columns / expert columns this rank owns."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int):
        for what, n in (
            ("num_attention_heads", config.num_heads),
            ("num_key_value_heads", config.num_kv_heads),
            ("intermediate_size", config.intermediate_size),
            ("moe_intermediate_size", config.moe_intermediate_size),
        ):
            if n % tp_size:
                raise ValueError(f"tp_size {tp_size} does not divide {what} {n}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        self.rank, self.size = tp_rank, tp_size
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.intermediate = config.intermediate_size // tp_size
        self.expert_intermediate = config.moe_intermediate_size // tp_size
        self.head_dim = config.head_dim

    def rows(self, per_rank: int) -> tuple[int, int]:
        return self.rank * per_rank, (self.rank + 1) * per_rank


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TPLayout, ops: Any,
                 all_reduce: AllReduce, **kw):  # fmt: skip
        super().__init__()
        self.tp, self.ops, self.all_reduce = tp, ops, all_reduce
        hd = config.head_dim
        self.q_size = tp.num_heads * hd
        self.kv_size = tp.num_kv_heads * hd
        self.scale = config.attn_scale
        self.window = config.layer_window(layer)
        self.soft_cap = config.attn_softcap
        self.rope_dim = config.rope_dim
        self.eps = config.rms_norm_eps
        # Sliding layers rotate with their own table when the config gives them one.
        self.local_rope = self.window is not None and config.local_rope_theta is not None
        # q, k and v stacked so one matmul produces all three.
        self.qkv_weight = weight(self.q_size + 2 * self.kv_size, config.hidden_size, **kw)
        self.qkv_bias = weight(self.q_size + 2 * self.kv_size, **kw) if config.qkv_bias else None
        self.o_weight = weight(config.hidden_size, self.q_size, **kw)
        self.o_bias = weight(config.hidden_size, **kw) if config.o_bias else None
        self.q_norm = weight(hd, **kw) if config.qk_norm else None
        self.k_norm = weight(hd, **kw) if config.qk_norm else None
        # The same weights laid out for oneDNN, once loaded (LlamaModel.pack_weights).
        self.qkv_packed: torch.Tensor | None = None
        self.o_packed: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        cos_sin: torch.Tensor,  # [max_pos, rope_dim]
        attn: AttentionInputs,
        k_cache: torch.Tensor,  # [num_blocks + 1, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        n, hd = x.shape[0], self.tp.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed)  # [num_tokens, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.tp.num_heads, hd)  # [num_tokens, num_heads, head_dim]
        k = k.reshape(n, self.tp.num_kv_heads, hd)  # [num_tokens, num_kv_heads, head_dim]
        v = v.reshape(n, self.tp.num_kv_heads, hd)
        if self.q_norm is not None:  # each head normalised on its own, before rotary
            q = self.ops.rms_norm(q.reshape(-1, hd), self.q_norm, self.eps).view(q.shape)
            k = self.ops.rms_norm(k.reshape(-1, hd), self.k_norm, self.eps).view(k.shape)
        q, k = self._rotate(positions, q, k, cos_sin)
        self.ops.store_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        out = self.ops.paged_attention(
            q,
            k_cache,
            v_cache,
            attn.block_tables,
            attn.seq_lens,
            attn.query_start_loc,
            self.scale,
            max_query_len=attn.max_query_len,
            max_seq_len=attn.max_seq_len,
            window=self.window,
            soft_cap=self.soft_cap,
        )  # [num_tokens, num_heads, head_dim]
        out = self.all_reduce(
            linear(out.reshape(n, self.q_size), self.o_weight, None, self.o_packed)
        )
        if self.o_bias is not None:
            # Added once, after the reduction, not once per rank.
            out = out + self.o_bias
        return out  # [num_tokens, hidden]

    def _rotate(self, positions, q, k, cos_sin):
        """Rotary on the first ``rope_dim`` of each head; the rest passes through."""
        r = self.rope_dim
        if r == q.shape[-1]:
            return self.ops.rotary_embedding(positions, q, k, cos_sin)
        q_rot, k_rot = self.ops.rotary_embedding(positions, q[..., :r], k[..., :r], cos_sin)
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPLayout, ops: Any, all_reduce: AllReduce, **kw):
        super().__init__()
        self.ops, self.all_reduce = ops, all_reduce
        self.act = activation_op(config)
        inter = tp.intermediate
        # gate rows first, then up rows: the layout silu_mul expects.
        self.gate_up_weight = weight(2 * inter, config.hidden_size, **kw)
        self.gate_up_bias = weight(2 * inter, **kw) if config.mlp_bias else None
        self.down_weight = weight(config.hidden_size, inter, **kw)
        self.down_bias = weight(config.hidden_size, **kw) if config.mlp_bias else None
        self.gate_up_packed: torch.Tensor | None = None
        self.down_packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_packed)
        h = getattr(self.ops, self.act)(h)  # [num_tokens, inter]
        out = self.all_reduce(linear(h, self.down_weight, None, self.down_packed))
        if self.down_bias is not None:
            out = out + self.down_bias
        return out

    def pack(self) -> None:
        self.gate_up_packed = pack_weight(self.gate_up_weight)
        self.down_packed = pack_weight(self.down_weight)


def activation_op(config: ModelConfig) -> str:
    """The kernel op of the MLP's gated activation."""
    return {"silu": "silu_mul", "gelu_tanh": "gelu_tanh_mul"}[config.activation]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TPLayout, ops: Any,
                 all_reduce: AllReduce, **kw):  # fmt: skip
        super().__init__()
        from iterserve.workers.moe import SparseMoE

        self.ops, self.eps = ops, config.rms_norm_eps
        h = config.hidden_size
        self.input_norm = weight(h, **kw)
        self.post_attn_norm = weight(h, **kw)
        # Gemma normalises each sublayer's output too, before the residual add; its
        # MLP then gets a norm of its own (pre_mlp_norm) in place of post_attn_norm's.
        self.pre_mlp_norm = weight(h, **kw) if config.sandwich_norms else None
        self.post_mlp_norm = weight(h, **kw) if config.sandwich_norms else None
        self.attn = Attention(config, layer, tp, ops, all_reduce, **kw)
        if config.is_moe_layer(layer):
            self.mlp: nn.Module = SparseMoE(config, tp, ops, all_reduce, **kw)
        else:
            self.mlp = MLP(config, tp, ops, all_reduce, **kw)

    def forward(self, hidden, residual, positions, cos_sin, attn, k_cache, v_cache):
        """``(hidden, residual)`` in and out: the norms fuse the residual adds."""
        norm, eps = self.ops.rms_norm, self.eps
        if residual is None:
            residual, hidden = hidden, norm(hidden, self.input_norm, eps)
        else:
            hidden, residual = norm(hidden, self.input_norm, eps, residual)
        hidden = self.attn(hidden, positions, cos_sin, attn, k_cache, v_cache)
        if self.pre_mlp_norm is None:
            hidden, residual = norm(hidden, self.post_attn_norm, eps, residual)
            return self.mlp(hidden), residual
        hidden = norm(hidden, self.post_attn_norm, eps)
        hidden, residual = norm(hidden, self.pre_mlp_norm, eps, residual)
        return norm(self.mlp(hidden), self.post_mlp_norm, eps), residual


class LlamaModel(nn.Module):
    """Decoder stack plus LM head; ``forward`` returns logits for selected rows only."""

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
    ):
        super().__init__()
        self.config, self.ops = config, ops
        self.tp = TPLayout(config, tp_rank, tp_size)
        if tp_size > 1 and all_reduce is None:
            raise ValueError("tp_size > 1 needs an all_reduce callable")
        reduce = all_reduce if tp_size > 1 else _identity
        kw = {"dtype": dtype, "device": device}
        self.embed = weight(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.tp, ops, reduce, **kw) for i in range(config.num_layers)
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
                                        config.local_rope_scaling).to(device=device)  # fmt: skip
        self.register_buffer("cos_sin_local", local, persistent=False)
        # Gemma scales embeddings by sqrt(hidden), rounded to the weights' dtype as it does.
        self.embed_scale = None
        if config.scale_embeddings:
            self.embed_scale = torch.tensor(config.hidden_size**0.5).to(device=device, dtype=dtype)
        self.lm_head_packed: torch.Tensor | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        attn: AttentionInputs,
        kv: KVCache,
        logits_indices: torch.Tensor,  # [num_logits], rows of the flat batch
    ) -> torch.Tensor:
        c = self.config
        hidden = F.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        residual = None
        for i, layer in enumerate(self.layers):
            cos_sin = self.cos_sin_local if layer.attn.local_rope else self.cos_sin
            hidden, residual = layer(
                hidden, residual, positions, cos_sin, attn, kv.keys[i], kv.values[i]
            )
        # Only rows whose logits are wanted need the final norm and the (large)
        # vocabulary projection; both are row-wise, so gathering first is exact.
        hidden = hidden[logits_indices]  # [num_logits, hidden]
        if residual is None:
            hidden = self.ops.rms_norm(hidden, self.norm, c.rms_norm_eps)
        else:
            hidden, _ = self.ops.rms_norm(hidden, self.norm, c.rms_norm_eps,
                                          residual[logits_indices])  # fmt: skip
        logits = linear(hidden, self.lm_head, None, self.lm_head_packed)  # [num_logits, vocab]
        if c.final_softcap is not None:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    def pack_weights(self) -> bool:
        """Keeps a copy of every matrix product's weight in oneDNN's layout
        (:mod:`iterserve.kernels.cpu_linear`), used by batches of 16 rows or more;
        call after the weights are loaded. False (nothing kept) where it does not
        apply: not fp32 on the CPU, or no oneDNN in this build."""
        for layer in self.layers:
            a = layer.attn
            a.qkv_packed, a.o_packed = pack_weight(a.qkv_weight), pack_weight(a.o_weight)
            layer.mlp.pack()
        self.lm_head_packed = pack_weight(self.lm_head)
        return self.lm_head_packed is not None

    def set_ops(self, ops: Any) -> None:
        """Runs the same weights on another kernel backend (for comparisons)."""
        self.ops = ops
        for layer in self.layers:
            layer.ops = layer.attn.ops = layer.mlp.ops = ops

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

    def load_weights(self, ckpt: Checkpoint) -> None:
        """Copies this rank's shard of every tensor of the checkpoint into place."""
        from iterserve.workers.weights import load_weights

        load_weights(self, ckpt)


def weight_bytes(
    config: ModelConfig, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1
) -> int:
    """Bytes of one rank's weights: the model built on the meta device, so the
    count follows the model's own definition and allocates nothing."""
    model = LlamaModel(
        config,
        None,
        torch.empty(0, config.rope_dim),
        dtype=dtype,
        device="meta",
        tp_rank=tp_rank,
        tp_size=tp_size,
        all_reduce=_identity,
    )
    # The tied LM head is the embedding itself: parameters() yields it once.
    return sum(p.numel() * p.element_size() for p in model.parameters())
