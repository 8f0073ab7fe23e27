"""What the shared decoder (:mod:`.model`) builds a model from.

:class:`ModelConfig` is a checkpoint's shape (sizes, heads, vocabulary), its
rope, what the model does at its two ends (scaled embeddings, a tied or
soft-capped LM head), its experts' sizes, and one :class:`LayerSpec` per layer:
norm placement, q/k norms, biases, the sliding window, the rope table, the soft
cap on scores, the MLP's kind and activation. Nothing here names an
architecture's feature as a flag: each architecture's parser
(:mod:`.architectures`) reads its ``config.json`` into these, with the readers
below, and the decoder reads only these. Both rope spellings in the wild are
read: transformers >= 5 writes ``rope_parameters`` (theta inside), older files
``rope_theta`` plus an optional ``rope_scaling``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer types
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
        """``config.json``, read by its architecture's parser (:mod:`.architectures`)."""
        from .architectures import parse_architecture

        return parse_architecture(raw)


def common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields every architecture reads the same way, and ``num_layers`` for its
    parser (the config counts its layers' specs)."""
    hidden = get_int(raw, "hidden_size")
    heads = get_int(raw, "num_attention_heads")
    kv_heads = get_int(raw, "num_key_value_heads", default=heads)
    head_dim = get_int(raw, "head_dim", default=None)
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(
                f"config.json: hidden_size {hidden} is not divisible by "
                f"num_attention_heads {heads} and no head_dim is given"
            )
        head_dim = hidden // heads
    if heads % kv_heads:
        raise CheckpointError(
            f"config.json: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}"
        )
    if head_dim % 2:
        raise CheckpointError(f"config.json: head_dim must be even for rotary, got {head_dim}")
    if raw.get("quantization_config") is not None:
        raise CheckpointError("config.json: 'quantization_config' is set; quantized weights are "
                              "not supported")  # fmt: skip
    return dict(
        architecture=raw["architectures"][0],
        vocab_size=get_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=get_int(raw, "intermediate_size"),
        num_layers=get_int(raw, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get_float(raw, "rms_norm_eps", default=1e-6),
        max_position_embeddings=get_int(raw, "max_position_embeddings", default=4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        bos_token_id=_opt_int(raw, "bos_token_id"),
        eos_token_ids=token_id_list(raw.get("eos_token_id"), "config.json: eos_token_id"),
        pad_token_id=_opt_int(raw, "pad_token_id"),
    )


def get_int(raw: dict[str, Any], key: str, default: Any = ...) -> Any:
    if key not in raw or raw[key] is None:
        if default is ...:
            raise CheckpointError(f"config.json: required field {key!r} is missing")
        return default
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"config.json: {key!r} must be a positive integer, got {value!r}")
    return value


def _opt_int(raw: dict[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"config.json: {key!r} must be a token id, got {value!r}")
    return value


def get_float(raw: dict[str, Any], key: str, default: float | None) -> Any:
    value = raw.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise CheckpointError(f"config.json: {key!r} must be a positive number, got {value!r}")
    return float(value)


def token_id_list(value: Any, where: str) -> tuple[int, ...]:
    """An ``eos_token_id``-style field: ``None``, an int or a list of ints."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CheckpointError(f"{where} must be a token id or a list of them, got {value!r}")
    return tuple(values)


def rope_fields(raw: dict[str, Any], params: dict[str, Any] | None = None,
                theta_key: str = "rope_theta", default_theta: float = 10000.0,
                ) -> tuple[float, dict[str, Any] | None]:  # fmt: skip
    """``(rope_theta, rope_scaling)`` from the config, or from ``params`` (one layer
    type's entry of a nested ``rope_parameters``). ``rope_scaling`` is None for the
    default type; otherwise it holds the type and what that type reads, checked."""
    if params is None:
        params = raw.get("rope_parameters")
        scaling = raw.get("rope_scaling")
        if params is not None and not isinstance(params, dict):
            raise CheckpointError("config.json: 'rope_parameters' must be an object")
        if scaling is not None and not isinstance(scaling, dict):
            raise CheckpointError("config.json: 'rope_scaling' must be an object or null")
        merged: dict[str, Any] = dict(scaling or {})
        merged.update(params or {})
    else:
        merged = dict(params)
    theta = merged.pop("rope_theta", raw.get(theta_key, default_theta))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise CheckpointError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    merged.pop("partial_rotary_factor", None)  # read with the head's shape
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"config.json: unsupported rope type {rope_type!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    original = merged.get("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings"))  # fmt: skip
    if original is not None:
        merged["original_max_position_embeddings"] = original
    if rope_type == "longrope" and merged.get("factor") is None and original:
        # transformers' default: how far max_position_embeddings stretches the original
        merged["factor"] = get_int(raw, "max_position_embeddings", default=4096) / original
    needed = {
        "linear": ["factor"],
        "llama3": ["factor", "low_freq_factor", "high_freq_factor",
                   "original_max_position_embeddings"],
        "yarn": ["factor", "original_max_position_embeddings"],
        "longrope": ["factor", "original_max_position_embeddings"],
    }[rope_type]  # fmt: skip
    for key in needed:
        if not isinstance(merged.get(key), (int, float)) or isinstance(merged.get(key), bool):
            raise CheckpointError(f"config.json: {rope_type} rope scaling needs a numeric {key!r}")
    return float(theta), {"rope_type": rope_type, **merged}


def check_longrope(scaling: dict[str, Any] | None, rope_dim: int, max_positions: int) -> None:
    """A ``longrope`` scaling's factor lists: ``short_factor`` always, ``long_factor``
    when the model reaches past its original context (``max_positions`` more than
    ``original_max_position_embeddings``: an engine serving that much takes it), each
    ``rope_dim / 2`` numbers; a ``long_factor`` given is checked even when unused."""
    if not scaling or scaling.get("rope_type") != "longrope":
        return
    original = scaling["original_max_position_embeddings"]
    for key in ("short_factor", "long_factor"):
        value = scaling.get(key)
        if value is None and key == "short_factor":
            raise CheckpointError("config.json: longrope rope scaling needs a 'short_factor' list")
        if value is None and max_positions > original:
            raise CheckpointError(
                "config.json: longrope rope scaling needs a 'long_factor' list to serve past "
                f"original_max_position_embeddings ({original}), up to max_position_embeddings "
                f"({max_positions})"
            )
        if value is None:
            continue
        if not isinstance(value, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value
        ):
            raise CheckpointError(
                f"config.json: longrope {key!r} must be a list of positive numbers, got {value!r}"
            )
        if len(value) != rope_dim // 2:
            raise CheckpointError(
                f"config.json: longrope {key!r} has {len(value)} values; it needs "
                f"{rope_dim // 2}, one per pair of the {rope_dim} rotated dimensions"
            )
