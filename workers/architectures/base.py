"""What a family declares for each architecture: how its ``config.json`` reads
(:attr:`Architecture.parse`) and how its checkpoints name their tensors
(:class:`WeightNames`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .keys import Fields, Raw


@dataclass(frozen=True)
class WeightNames:
    """The checkpoint's tensor (transformers' name, without ``.weight``/``.bias``)
    behind each of the decoder's parameters; the defaults are Llama's.

    Names under a layer are relative to ``layer`` (formatted with the layer's
    index); an expert's to ``expert`` (with the expert's). A stacked parameter
    names its parts in row order: several names are several tensors stacked, one
    name is one tensor holding the parts' rows in that order (Phi-3's fused
    ``qkv_proj``). :mod:`..weights` slices each part for this rank.
    """

    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    layer: str = "model.layers.{}."
    input_norm: str = "input_layernorm"
    post_attn_norm: str = "post_attention_layernorm"
    pre_mlp_norm: str = "pre_feedforward_layernorm"  # SANDWICH layers
    post_mlp_norm: str = "post_feedforward_layernorm"  # SANDWICH layers
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    o: str = "self_attn.o_proj"
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    down: str = "mlp.down_proj"
    router: str = "mlp.gate"  # MOE layers
    expert: str = "mlp.experts.{}."
    expert_gate_up_down: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Added to every norm's stored scale (Gemma stores scale - 1).
    norm_offset: float = 0.0

    def __post_init__(self) -> None:
        if len(self.qkv) not in (1, 3) or len(self.gate_up) not in (1, 2):
            raise ValueError("qkv names one fused tensor or three; gate_up one or two")


@dataclass(frozen=True)
class Architecture:
    """One ``architectures`` name a checkpoint may give: ``parse`` reads its config
    (given the fields every architecture shares, :func:`.keys.common_fields`) into
    the rest of :class:`..config.ModelConfig`'s fields, ``layers`` among them;
    ``weights`` names its tensors."""

    parse: Callable[[Raw, Fields], Fields]
    weights: WeightNames = field(default_factory=WeightNames)
