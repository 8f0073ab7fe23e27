"""``config.json`` of a Llama-family checkpoint, parsed and validated once.

Both spellings in the wild are read: transformers >= 5 writes
``rope_parameters`` (theta inside), older files ``rope_theta`` plus an optional
``rope_scaling``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    sliding_window: int | None = None
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def max_model_len(self) -> int:
        """Longest sequence computed exactly.

        Attention here is always full; a sliding-window model matches it only
        while the whole sequence fits in the window.
        """
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures")
        if not isinstance(archs, list) or not archs:
            raise CheckpointError("config.json: 'architectures' is missing or not a non-empty list")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"config.json: unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"config.json: hidden_act must be 'silu', got {act!r}")

        hidden = _int(raw, "hidden_size")
        heads = _int(raw, "num_attention_heads")
        kv_heads = _int(raw, "num_key_value_heads", default=heads)
        head_dim = _int(raw, "head_dim", default=None)
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

        rope_theta, rope_scaling = _rope(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        qwen = arch == "Qwen2ForCausalLM"
        sliding = raw.get("sliding_window")
        if qwen and not raw.get("use_sliding_window", False):
            sliding = None
        if sliding is not None and (not isinstance(sliding, int) or sliding <= 0):
            raise CheckpointError(
                f"config.json: sliding_window must be a positive int, got {sliding!r}"
            )
        return cls(
            architecture=arch,
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size"),
            num_layers=_int(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_float(raw, "rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=_int(raw, "max_position_embeddings", default=4096),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; Llama's flag covers all four.
            qkv_bias=qwen or attention_bias,
            o_bias=(not qwen) and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=sliding,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            bos_token_id=_opt_int(raw, "bos_token_id"),
            eos_token_ids=token_id_list(raw.get("eos_token_id"), "config.json: eos_token_id"),
            pad_token_id=_opt_int(raw, "pad_token_id"),
        )


def _int(raw: dict[str, Any], key: str, default: Any = ...) -> Any:
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


def _float(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
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


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes "rope_parameters" (theta inside); older files
    # write "rope_theta" plus an optional "rope_scaling". Both are in the wild.
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise CheckpointError("config.json: 'rope_parameters' must be an object")
    if scaling is not None and not isinstance(scaling, dict):
        raise CheckpointError("config.json: 'rope_scaling' must be an object or null")
    merged: dict[str, Any] = dict(scaling or {})
    merged.update(params or {})
    theta = merged.pop("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise CheckpointError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"config.json: unsupported rope type {rope_type!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    needed = ["factor"]
    if rope_type == "llama3":
        needed += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    for key in needed:
        if not isinstance(merged.get(key), (int, float)) or isinstance(merged.get(key), bool):
            raise CheckpointError(f"config.json: {rope_type} rope scaling needs a numeric {key!r}")
    return float(theta), {"rope_type": rope_type, **merged}
