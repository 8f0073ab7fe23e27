"""``config.json`` of a checkpoint, parsed and validated once.

The fields every architecture shares are read here; what each architecture
adds or changes (q/k norms, Gemma's norms and scales, sliding-window layers,
experts) is read by :mod:`~iterserve.workers.architectures`, which also
refuses, naming the key, whatever a config asks for that the runtime does not
compute. Both rope spellings in the wild are read: transformers >= 5 writes
``rope_parameters`` (theta inside), older files ``rope_theta`` plus an optional
``rope_scaling``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
FULL, SLIDING = "full_attention", "sliding_attention"


class CheckpointError(ValueError):
    """A checkpoint directory cannot be served; the message names the problem."""


@dataclass(frozen=True)
class ModelConfig:
    """The parts of ``config.json`` the runtime needs, validated once."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # The window of the layers that slide (all of them unless layer_types says).
    sliding_window: int | None = None
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Per layer, FULL or SLIDING; None: every layer slides when sliding_window is set.
    layer_types: tuple[str, ...] | None = None
    qk_norm: bool = False  # RMSNorm over each query and key head before rotary (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # Gemma stores every norm's scale as weight - 1
    sandwich_norms: bool = False  # Gemma: a norm after attention and after the MLP too
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attention scale ** -2 (Gemma); else head_dim
    attn_softcap: float | None = None  # scores capped as cap * tanh(score / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    activation: str = "silu"  # or "gelu_tanh"
    rotary_dim: int | None = None  # rotated width of a head; None: all of it
    # Rope of the sliding layers when it differs (Gemma 3's local base).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    num_experts: int = 0  # mixture of experts: 0 for a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP

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
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None for full attention."""
        if self.layer_types is None or self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    @property
    def kv_window(self) -> int | None:
        """The window within which every layer reads, None when any layer reads the
        whole sequence: KV blocks before it are no layer's any more (what the
        scheduler frees while a sequence runs)."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return None if None in windows else max(windows)  # type: ignore[type-var]

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        from .architectures import parse_architecture

        return parse_architecture(raw)


def common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields every architecture reads the same way."""
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
