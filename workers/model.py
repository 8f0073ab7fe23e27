"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat token batch.

Every step computes one flat batch: the tokens of all scheduled sequences laid
end to end, ``[num_tokens, ...]``, whatever mix of decodes and prefill pieces
it holds; per-sequence structure lives only in :class:`AttentionInputs`.

Tensor parallelism (Megatron layout): q/k/v and gate/up are split by output
(column-parallel, whole heads per rank), o_proj and down_proj by input
(row-parallel) and each is followed by one all-reduce. Embeddings, norms and
the LM head are replicated, so every rank ends with the same full logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.kernels.cpu_linear import linear, packs_every_batch
from iterserve.kernels.cpu_linear import pack as pack_weight
from iterserve.workers.config import CheckpointError, ModelConfig
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


def _weight(*shape: int, dtype: torch.dtype, device: Any) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class TPLayout:
    """Which heads / MLP columns this rank owns."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int):
        for what, n in (
            ("num_attention_heads", config.num_heads),
            ("num_key_value_heads", config.num_kv_heads),
            ("intermediate_size", config.intermediate_size),
        ):
            if n % tp_size:
                raise ValueError(f"tp_size {tp_size} does not divide {what} {n}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        self.rank, self.size = tp_rank, tp_size
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.intermediate = config.intermediate_size // tp_size
        self.head_dim = config.head_dim

    def rows(self, per_rank: int) -> tuple[int, int]:
        return self.rank * per_rank, (self.rank + 1) * per_rank


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPLayout, ops: Any, all_reduce: AllReduce, **kw):
        super().__init__()
        self.tp, self.ops, self.all_reduce = tp, ops, all_reduce
        hd = config.head_dim
        self.q_size = tp.num_heads * hd
        self.kv_size = tp.num_kv_heads * hd
        self.scale = hd**-0.5
        # q, k and v stacked so one matmul produces all three.
        self.qkv_weight = _weight(self.q_size + 2 * self.kv_size, config.hidden_size, **kw)
        self.qkv_bias = _weight(self.q_size + 2 * self.kv_size, **kw) if config.qkv_bias else None
        self.o_weight = _weight(config.hidden_size, self.q_size, **kw)
        self.o_bias = _weight(config.hidden_size, **kw) if config.o_bias else None
        # The same weights laid out for oneDNN, once loaded (LlamaModel.pack_weights).
        self.qkv_packed: torch.Tensor | None = None
        self.o_packed: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        cos_sin: torch.Tensor,  # [max_pos, head_dim]
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
        q, k = self.ops.rotary_embedding(positions, q, k, cos_sin)
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
        )  # [num_tokens, num_heads, head_dim]
        out = self.all_reduce(
            linear(out.reshape(n, self.q_size), self.o_weight, None, self.o_packed)
        )
        if self.o_bias is not None:
            # Added once, after the reduction, not once per rank.
            out = out + self.o_bias
        return out  # [num_tokens, hidden]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPLayout, ops: Any, all_reduce: AllReduce, **kw):
        super().__init__()
        self.ops, self.all_reduce = ops, all_reduce
        inter = tp.intermediate
        # gate rows first, then up rows: the layout silu_mul expects.
        self.gate_up_weight = _weight(2 * inter, config.hidden_size, **kw)
        self.gate_up_bias = _weight(2 * inter, **kw) if config.mlp_bias else None
        self.down_weight = _weight(config.hidden_size, inter, **kw)
        self.down_bias = _weight(config.hidden_size, **kw) if config.mlp_bias else None
        self.gate_up_packed: torch.Tensor | None = None
        self.down_packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_packed)
        h = self.ops.silu_mul(h)  # [num_tokens, inter]
        out = self.all_reduce(linear(h, self.down_weight, None, self.down_packed))
        if self.down_bias is not None:
            out = out + self.down_bias
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPLayout, ops: Any, all_reduce: AllReduce, **kw):
        super().__init__()
        self.ops, self.eps = ops, config.rms_norm_eps
        self.input_norm = _weight(config.hidden_size, **kw)
        self.post_attn_norm = _weight(config.hidden_size, **kw)
        self.attn = Attention(config, tp, ops, all_reduce, **kw)
        self.mlp = MLP(config, tp, ops, all_reduce, **kw)


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
        self.embed = _weight(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.tp, ops, reduce, **kw) for _ in range(config.num_layers)
        )
        self.norm = _weight(config.hidden_size, **kw)
        self.lm_head = (
            self.embed
            if config.tie_word_embeddings
            else _weight(config.vocab_size, config.hidden_size, **kw)
        )
        self.register_buffer("cos_sin", cos_sin.to(device=device), persistent=False)
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
        eps = self.config.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = hidden
                hidden = self.ops.rms_norm(hidden, layer.input_norm, eps)
            else:
                hidden, residual = self.ops.rms_norm(hidden, layer.input_norm, eps, residual)
            hidden = layer.attn(hidden, positions, self.cos_sin, attn, kv.keys[i], kv.values[i])
            hidden, residual = self.ops.rms_norm(hidden, layer.post_attn_norm, eps, residual)
            hidden = layer.mlp(hidden)
        # Only rows whose logits are wanted need the final norm and the (large)
        # vocabulary projection; both are row-wise, so gathering first is exact.
        hidden = hidden[logits_indices]  # [num_logits, hidden]
        if residual is None:
            hidden = self.ops.rms_norm(hidden, self.norm, eps)
        else:
            hidden, _ = self.ops.rms_norm(hidden, self.norm, eps, residual[logits_indices])
        return linear(hidden, self.lm_head, None, self.lm_head_packed)  # [num_logits, vocab]

    def pack_weights(self) -> bool:
        """Keeps every matrix product's weight in oneDNN's layout
        (:mod:`iterserve.kernels.cpu_linear`); call after the weights are loaded.
        fp32 keeps the plain weight too, for batches under 16 rows; bf16 products
        all take the packed one, so its plain weights are let go (but the embedding,
        which the first layer reads by row). False (nothing packed) where it does
        not apply: not fp32 or bf16 on the CPU, or no oneDNN in this build."""
        for layer in self.layers:
            a, m = layer.attn, layer.mlp
            a.qkv_packed, a.o_packed = pack_weight(a.qkv_weight), pack_weight(a.o_weight)
            m.gate_up_packed = pack_weight(m.gate_up_weight)
            m.down_packed = pack_weight(m.down_weight)
        self.lm_head_packed = pack_weight(self.lm_head)
        if self.lm_head_packed is None:
            return False
        if packs_every_batch(self.embed.dtype):
            for layer in self.layers:
                a, m = layer.attn, layer.mlp
                for weight in (a.qkv_weight, a.o_weight, m.gate_up_weight, m.down_weight):
                    weight.data = weight.data.new_empty(0)
            if self.lm_head is not self.embed:
                self.lm_head.data = self.lm_head.data.new_empty(0)
        return True

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
        """Copies this rank's shard of every HF tensor into place."""
        c, tp = self.config, self.tp
        hd = c.head_dim
        q_rows = tuple(x * hd for x in tp.rows(tp.num_heads))
        kv_rows = tuple(x * hd for x in tp.rows(tp.num_kv_heads))
        mlp_rows = tp.rows(tp.intermediate)

        def put(dst: torch.Tensor, name: str, dim: int | None = None, span=(0, None)) -> None:
            # Checked on the whole tensor: a slice of a wrong-sized one can look right.
            full = list(dst.shape)
            if dim is not None:
                full[dim] *= tp.size
            if ckpt.shape(name) != tuple(full):
                raise CheckpointError(
                    f"weights: {name} has shape {ckpt.shape(name)}, expected {tuple(full)}"
                )
            src = ckpt.get(name, dim, *span) if dim is not None else ckpt.get(name)
            with torch.no_grad():
                dst.copy_(src)

        put(self.embed, "model.embed_tokens.weight")
        put(self.norm, "model.norm.weight")
        if not c.tie_word_embeddings:
            put(self.lm_head, "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a, m = layer.attn, layer.mlp
            put(layer.input_norm, p + "input_layernorm.weight")
            put(layer.post_attn_norm, p + "post_attention_layernorm.weight")
            q, kv = a.q_size, a.kv_size
            for suffix, stacked in (("weight", a.qkv_weight), ("bias", a.qkv_bias)):
                if stacked is None:
                    continue
                put(stacked[:q], f"{p}self_attn.q_proj.{suffix}", 0, q_rows)
                put(stacked[q : q + kv], f"{p}self_attn.k_proj.{suffix}", 0, kv_rows)
                put(stacked[q + kv :], f"{p}self_attn.v_proj.{suffix}", 0, kv_rows)
            put(a.o_weight, p + "self_attn.o_proj.weight", 1, q_rows)
            if a.o_bias is not None:
                put(a.o_bias, p + "self_attn.o_proj.bias")
            inter = tp.intermediate
            for suffix, stacked in (("weight", m.gate_up_weight), ("bias", m.gate_up_bias)):
                if stacked is None:
                    continue
                put(stacked[:inter], f"{p}mlp.gate_proj.{suffix}", 0, mlp_rows)
                put(stacked[inter:], f"{p}mlp.up_proj.{suffix}", 0, mlp_rows)
            put(m.down_weight, p + "mlp.down_proj.weight", 1, mlp_rows)
            if m.down_bias is not None:
                put(m.down_bias, p + "mlp.down_proj.bias")


def weight_bytes(
    config: ModelConfig, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1
) -> int:
    """Bytes of one rank's weights: the model built on the meta device, so the
    count follows the model's own definition and allocates nothing."""
    model = LlamaModel(
        config,
        None,
        torch.empty(0),
        dtype=dtype,
        device="meta",
        tp_rank=tp_rank,
        tp_size=tp_size,
        all_reduce=_identity,
    )
    # The tied LM head is the embedding itself: parameters() yields it once.
    return sum(p.numel() * p.element_size() for p in model.parameters())
