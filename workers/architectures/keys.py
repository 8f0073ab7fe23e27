"""Reading ``config.json``: the keys every architecture reads the same way, and
the helpers each family's parser is made of.

Every reader follows transformers' config classes: the same keys, the same
defaults when a key is absent. A key whose value asks for something the runtime
does not compute is refused with its name (:func:`refuse`); keys that only
matter to training (dropouts, router jitter, auxiliary losses) are ignored.
Both rope spellings in the wild are read: transformers >= 5 writes
``rope_parameters`` (theta inside), older files ``rope_theta`` plus an optional
``rope_scaling``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..config import CheckpointError, Experts, LayerSpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer types

Raw = dict[str, Any]  # config.json
Fields = dict[str, Any]  # ModelConfig's keyword arguments


def refuse(key: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"config.json: {key!r} is {value!r}; {why}")


def activation(raw: Raw, key: str = "hidden_act", allowed: dict[str, str] | None = None,
               default: str = "silu") -> str:  # fmt: skip
    """The MLP's activation under ``key``, as :class:`..config.LayerSpec` names it;
    ``allowed`` maps the config's spellings to those names (default: ``silu`` only)."""
    allowed = allowed or {"silu": "silu"}
    value = raw.get(key) or default
    if value not in allowed:
        raise refuse(key, value, f"supported: {', '.join(allowed)}")
    return allowed[value]


def window(raw: Raw) -> int | None:
    """``sliding_window``: a positive int, or None."""
    value = raw.get("sliding_window")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value <= 0):  # fmt: skip
        raise CheckpointError(f"config.json: sliding_window must be a positive int, got {value!r}")
    return value


def layer_types(raw: Raw, num_layers: int, derive: Callable[[int], str]) -> tuple[str, ...]:
    """The config's ``layer_types``, else the pattern transformers derives."""
    types = raw.get("layer_types")
    if types is None:
        return tuple(derive(i) for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers:
        raise refuse("layer_types", types, f"it needs one entry per layer ({num_layers})")
    for t in types:
        if t not in (FULL, SLIDING):
            raise refuse("layer_types", t, f"supported layer types: {FULL}, {SLIDING}")
    return tuple(types)


def slide(layer: LayerSpec, types: tuple[str, ...], size: int | None,
          local_rope: bool = False) -> tuple[LayerSpec, ...]:  # fmt: skip
    """``layer`` once per entry of ``types``: its sliding ones with window ``size``
    (and the local rope table when ``local_rope``), its full ones without."""
    local = local_rope and size is not None
    return tuple(layer if t == FULL else replace(layer, window=size, local_rope=local)
                 for t in types)  # fmt: skip


def attention_bias(raw: Raw) -> Fields:
    """``attention_bias``: biases on q, k, v and o together."""
    bias = bool(raw.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def experts(raw: Raw, num_key: str, size_key: str, renormalize: bool) -> Experts:
    """The experts' sizes under the config's keys, ``num_experts_per_tok`` a token."""
    e = Experts(get_int(raw, num_key), get_int(raw, "num_experts_per_tok"),
                get_int(raw, size_key), renormalize)  # fmt: skip
    if e.top_k > e.num_experts:
        raise refuse("num_experts_per_tok", e.top_k, f"more than the {e.num_experts} experts")
    return e


def rope(raw: Raw, **kw: Any) -> Fields:
    """The global rope's fields of ModelConfig (:func:`rope_fields`)."""
    theta, scaling = rope_fields(raw, **kw)
    return {"rope_theta": theta, "rope_scaling": scaling}


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
