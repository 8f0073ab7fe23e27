"""What each supported architecture reads from ``config.json`` beyond the common
fields into its layers' specs (:class:`.config.LayerSpec`), and what it refuses.

Every parser follows transformers' own config class: the same keys, the same
defaults when a key is absent (a Gemma 2 config without
``final_logit_softcapping`` caps at 30, as transformers does), the same
derived layer pattern. A key whose value asks for something the runtime does
not compute is refused with its name; keys that only matter to training
(dropouts, router jitter, auxiliary losses) are ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .config import (
    DENSE,
    FULL,
    MOE,
    SANDWICH,
    SLIDING,
    CheckpointError,
    Experts,
    LayerSpec,
    ModelConfig,
    check_longrope,
    common_fields,
    get_float,
    get_int,
    rope_fields,
)

Fields = dict[str, Any]


def parse_architecture(raw: dict[str, Any]) -> ModelConfig:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise CheckpointError("config.json: 'architectures' is missing or not a non-empty list")
    arch = archs[0]
    if arch not in PARSERS:
        raise CheckpointError(
            f"config.json: unsupported architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    fields = common_fields(raw)
    PARSERS[arch](raw, fields)
    num_layers = fields.pop("num_layers")  # the parser's to read; the config's is len(layers)
    assert len(fields["layers"]) == num_layers, f"{arch}: one LayerSpec per layer"
    config = ModelConfig(**fields)
    for scaling in (config.rope_scaling, config.local_rope_scaling):
        check_longrope(scaling, config.rope_dim, config.max_position_embeddings)
    return config


def _refuse(key: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"config.json: {key!r} is {value!r}; {why}")


def _activation(raw: dict[str, Any], key: str, allowed: dict[str, str], default: str) -> str:
    value = raw.get(key) or default
    if value not in allowed:
        raise _refuse(key, value, f"supported: {', '.join(allowed)}")
    return allowed[value]


def _window(raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window <= 0):  # fmt: skip
        raise CheckpointError(f"config.json: sliding_window must be a positive int, got {window!r}")
    return window


def _layer_types(raw: dict[str, Any], num_layers: int, derive: Callable[[int], str]):
    """The config's ``layer_types``, else the pattern transformers derives."""
    types = raw.get("layer_types")
    if types is None:
        return tuple(derive(i) for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers:
        raise _refuse("layer_types", types, f"it needs one entry per layer ({num_layers})")
    for t in types:
        if t not in (FULL, SLIDING):
            raise _refuse("layer_types", t, f"supported layer types: {FULL}, {SLIDING}")
    return tuple(types)


def _slide(layer: LayerSpec, types: tuple[str, ...], size: int | None,
           local_rope: bool = False) -> tuple[LayerSpec, ...]:  # fmt: skip
    """``layer`` once per entry of ``types``: its sliding ones with window ``size``
    (and the local rope table when ``local_rope``), its full ones without."""
    local = local_rope and size is not None
    return tuple(layer if t == FULL else replace(layer, window=size, local_rope=local)
                 for t in types)  # fmt: skip


def _attention_bias(raw: dict[str, Any]) -> Fields:
    bias = bool(raw.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def _rope(raw: dict[str, Any], f: Fields, **kw: Any) -> None:
    f["rope_theta"], f["rope_scaling"] = rope_fields(raw, **kw)


def _llama_layer(raw: dict[str, Any]) -> LayerSpec:
    act = _activation(raw, "hidden_act", {"silu": "silu"}, "silu")
    return LayerSpec(activation=act, **_attention_bias(raw),
                     mlp_bias=bool(raw.get("mlp_bias", False)))  # fmt: skip


def _llama(raw: dict[str, Any], f: Fields) -> None:
    f["layers"] = (_llama_layer(raw),) * f["num_layers"]
    _rope(raw, f)


def _mistral(raw: dict[str, Any], f: Fields) -> None:
    f["layers"] = (replace(_llama_layer(raw), window=_window(raw)),) * f["num_layers"]  # all slide
    _rope(raw, f)


def _qwen_windows(raw: dict[str, Any], f: Fields, layer: LayerSpec) -> None:
    # Qwen2 / Qwen3: a window only with use_sliding_window, on the layers from
    # max_window_layers on, unless layer_types says which.
    if not raw.get("use_sliding_window", False):
        f["layers"] = (layer,) * f["num_layers"]
        return
    size = _window(raw)
    first = raw.get("max_window_layers", 28)
    types = _layer_types(raw, f["num_layers"], lambda i: SLIDING if i >= first else FULL)
    f["layers"] = _slide(layer, types, size)


def _qwen2(raw: dict[str, Any], f: Fields) -> None:
    act = _activation(raw, "hidden_act", {"silu": "silu"}, "silu")
    _rope(raw, f)
    # Qwen2 always has q/k/v biases, none on o_proj.
    _qwen_windows(raw, f, LayerSpec(activation=act, qkv_bias=True))


def _qwen3(raw: dict[str, Any], f: Fields) -> None:
    act = _activation(raw, "hidden_act", {"silu": "silu"}, "silu")
    _rope(raw, f)
    _qwen_windows(raw, f, LayerSpec(activation=act, **_attention_bias(raw), qk_norm=True))


def _experts(raw: dict[str, Any], num_key: str, size_key: str, renormalize: bool) -> Experts:
    """The experts' sizes under the config's keys, ``num_experts_per_tok`` a token."""
    e = Experts(get_int(raw, num_key), get_int(raw, "num_experts_per_tok"),
                get_int(raw, size_key), renormalize)  # fmt: skip
    if e.top_k > e.num_experts:
        raise _refuse("num_experts_per_tok", e.top_k, f"more than the {e.num_experts} experts")
    return e


def _qwen3_moe(raw: dict[str, Any], f: Fields) -> None:
    act = _activation(raw, "hidden_act", {"silu": "silu"}, "silu")
    _rope(raw, f)
    layer = LayerSpec(activation=act, **_attention_bias(raw), qk_norm=True)
    if raw.get("use_sliding_window", False):
        layer = replace(layer, window=_window(raw))  # transformers slides every layer then
    f["experts"] = _experts(raw, "num_experts" if "num_experts" in raw else "num_local_experts",
                            "moe_intermediate_size",
                            renormalize=bool(raw.get("norm_topk_prob", False)))  # fmt: skip
    if raw.get("shared_expert_intermediate_size"):
        raise _refuse("shared_expert_intermediate_size", raw["shared_expert_intermediate_size"],
                      "shared experts are not supported")  # fmt: skip
    step = get_int(raw, "decoder_sparse_step", default=1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise _refuse("mlp_only_layers", only, "it must be a list of layer indices")
    dense = [i in only or (i + 1) % step != 0 for i in range(f["num_layers"])]
    f["layers"] = tuple(replace(layer, mlp=DENSE if d else MOE) for d in dense)


def _mixtral(raw: dict[str, Any], f: Fields) -> None:
    act = _activation(raw, "hidden_act", {"silu": "silu"}, "silu")
    _rope(raw, f, default_theta=1000000.0)
    f["layers"] = (LayerSpec(activation=act, window=_window(raw), mlp=MOE),) * f["num_layers"]
    # softmax, top-k, renormalised
    f["experts"] = _experts(raw, "num_local_experts", "intermediate_size", renormalize=True)


def _gemma(raw: dict[str, Any], f: Fields, *, attn_softcap: float | None,
           final_softcap: float | None, pattern: int, qk_norm: bool = False,
           local_rope: bool = False) -> None:  # fmt: skip
    key = "hidden_activation" if "hidden_activation" in raw else "hidden_act"
    act = _activation(raw, key, {"gelu_pytorch_tanh": "gelu_tanh"}, "gelu_pytorch_tanh")
    if raw.get("use_bidirectional_attention"):
        raise _refuse("use_bidirectional_attention", True, "only causal attention is supported")
    layer = LayerSpec(norms=SANDWICH, qk_norm=qk_norm, activation=act, **_attention_bias(raw),
                      soft_cap=_cap(raw, "attn_logit_softcapping", attn_softcap))  # fmt: skip
    f["scale_embeddings"] = True
    f["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", True))
    f["attn_scale_dim"] = get_float(raw, "query_pre_attn_scalar", 256)
    f["final_softcap"] = _cap(raw, "final_logit_softcapping", final_softcap)
    size = _window(raw) if "sliding_window" in raw else 4096
    types = _layer_types(raw, f["num_layers"], lambda i: SLIDING if (i + 1) % pattern else FULL)
    f["layers"] = _slide(layer, types, size, local_rope=local_rope)


def _cap(raw: dict[str, Any], key: str, default: float | None) -> float | None:
    """A soft-cap: the config's (null: none), else the architecture's default."""
    value = raw.get(key, default)
    return None if value is None else get_float({key: value}, key, None)


def _gemma2(raw: dict[str, Any], f: Fields) -> None:
    _gemma(raw, f, attn_softcap=50.0, final_softcap=30.0, pattern=2)
    _rope(raw, f)


def _gemma3(raw: dict[str, Any], f: Fields) -> None:
    if raw.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 reads the key but never applies it: no reference to match
        raise _refuse("attn_logit_softcapping", raw["attn_logit_softcapping"],
                      "Gemma 3 attention is not soft-capped")  # fmt: skip
    pattern = get_int(raw, "sliding_window_pattern", default=6)
    _gemma(raw, f, attn_softcap=None, final_softcap=None, pattern=pattern, qk_norm=True,
           local_rope=True)  # fmt: skip
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:  # one entry per layer type
        f["rope_theta"], f["rope_scaling"] = rope_fields(raw, params=params[FULL] or {},
                                                         default_theta=1000000.0)  # fmt: skip
        local = params.get(SLIDING) or {}
        f["local_rope_theta"], f["local_rope_scaling"] = rope_fields(raw, params=local)
    else:  # the older spelling: the scaling is the global layers'
        _rope(raw, f, default_theta=1000000.0)
        f["local_rope_theta"] = get_float(raw, "rope_local_base_freq", 10000.0)


def _phi3(raw: dict[str, Any], f: Fields) -> None:
    act = _activation(raw, "hidden_act", {"silu": "silu"}, "silu")
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):
        params["rope_type"] = "longrope"  # transformers' Phi-3 reads both as longrope
        params.pop("type", None)
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise _refuse("partial_rotary_factor", partial, "it must be in (0, 1]")
    rotary = int(f["head_dim"] * partial)
    if rotary % 2:
        raise _refuse("partial_rotary_factor", partial, f"it rotates {rotary} (odd) dimensions")
    f["rotary_dim"] = rotary if rotary != f["head_dim"] else None
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    f["rope_theta"], f["rope_scaling"] = rope_fields(raw, params={"rope_theta": theta, **params})
    f["layers"] = (LayerSpec(activation=act, window=_window(raw)),) * f["num_layers"]  # all slide


PARSERS: dict[str, Callable[[dict[str, Any], Fields], None]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "MixtralForCausalLM": _mixtral,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "Phi3ForCausalLM": _phi3,
}
SUPPORTED_ARCHITECTURES = tuple(PARSERS)
