"""What the shared decoder (:mod:`.model`) builds a model from.

:class:`ModelConfig` is a checkpoint's shape (sizes, heads, vocabulary), its
rope, what the model does at its two ends (scaled embeddings, a tied or
soft-capped LM head), its experts' sizes, and one :class:`LayerSpec` per layer:
norm placement, q/k norms, biases, the sliding window, the rope table, the soft
cap on scores, the MLP's kind and activation. Nothing here names an
architecture's feature as a flag: a family (:mod:`.architectures`) reads its
``config.json`` into these, and the decoder reads only these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PRE, SANDWICH = "pre", "sandwich"
DENSE, MOE = "dense", "moe"
ACTIVATIONS = ("silu", "gelu_tanh")


class CheckpointError(ValueError):
    """A checkpoint directory cannot be served; the message names the problem."""


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer computes, beyond the model's shape."""

    # PRE: a norm before attention and one before the MLP, each fused with the
    # residual add; SANDWICH (Gemma): a norm after each sublayer's output too, and
    # the MLP's own norm before it.
    norms: str = PRE
    qk_norm: bool = False  # RMSNorm over each query and key head before rotary
    qkv_bias: bool = False
    o_bias: bool = False  # added once, after the all-reduce
    window: int | None = None  # reads positions p - window + 1 .. p; None: all of them
    local_rope: bool = False  # rotates with the model's local table (Gemma 3's sliding layers)
    soft_cap: float | None = None  # scores capped as cap * tanh(score / cap)
    mlp: str = DENSE  # MOE: the model's experts in place of the dense MLP
    activation: str = "silu"  # the MLP's (or experts') gate: silu or gelu_tanh
    mlp_bias: bool = False  # gate/up and down biases of the dense MLP

    def __post_init__(self) -> None:
        if self.norms not in (PRE, SANDWICH) or self.mlp not in (DENSE, MOE):
            raise ValueError(f"unknown norm placement or MLP kind: {self.norms!r}, {self.mlp!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}")


@dataclass(frozen=True)
class Experts:
    """A mixture of experts' sizes and routing, shared by its MOE layers."""

    num_experts: int
    top_k: int  # experts a token uses
    intermediate_size: int  # one expert's MLP width
    renormalize: bool = True  # the chosen experts' weights rescaled to sum to 1


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint's model as the decoder builds it, validated once."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    layers: tuple[LayerSpec, ...]  # one per layer
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    rotary_dim: int | None = None  # rotated width of a head; None: all of it
    # The table of layers with local_rope (Gemma 3's local base).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attn_scale_dim: float | None = None  # scores times attn_scale_dim ** -0.5; None: head_dim
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    tie_word_embeddings: bool = False
    final_softcap: float | None = None  # the logits capped as cap * tanh(logit / cap)
    experts: Experts | None = None  # the MOE layers' experts
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if any(s.mlp == MOE for s in self.layers) and self.experts is None:
            raise ValueError("a mixture-of-experts layer needs the model's experts")
        if any(s.local_rope for s in self.layers) and self.local_rope_theta is None:
            raise ValueError("a layer with the local rope needs local_rope_theta")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_model_len(self) -> int:
        """Longest sequence the checkpoint serves: ``max_position_embeddings``, a
        ``longrope`` model's too (Phi-3-mini-128k: 131072). Which of a longrope
        model's factors its rope table takes depends on the context the engine
        resolves from this and its configuration (:func:`.model.rope_table`)."""
        return self.max_position_embeddings

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.attn_scale_dim or self.head_dim) ** -0.5

    @property
    def kv_window(self) -> int | None:
        """The window within which every layer reads, None when any layer reads the
        whole sequence: KV blocks before it are no layer's any more (what the
        scheduler frees while a sequence runs)."""
        windows = {spec.window for spec in self.layers}
        return None if None in windows else max(windows)  # type: ignore[type-var]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """``config.json``, read by its architecture's family (:mod:`.architectures`)."""
        from .architectures import parse_config

        return parse_config(raw)
