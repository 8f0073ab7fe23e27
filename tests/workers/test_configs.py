"""Each architecture's config: its keys read with transformers' defaults into the
layers' specs, and what the runtime does not compute refused with the key named."""

from __future__ import annotations

import pytest

from iterserve.workers import CheckpointError, ModelConfig
from iterserve.workers.architectures import ARCHITECTURES, SUPPORTED_ARCHITECTURES, weight_names
from iterserve.workers.architectures.keys import FULL
from iterserve.workers.config import DENSE, MOE, SANDWICH, LayerSpec

SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def config(arch: str, **keys) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": [arch], **SHAPE, **keys})


def test_an_unlisted_architecture_is_refused_with_the_supported_list():
    with pytest.raises(CheckpointError) as e:
        config("GPT2LMHeadModel")
    assert "unsupported architecture 'GPT2LMHeadModel'; supported: " in str(e.value)
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)
    assert len(SUPPORTED_ARCHITECTURES) == 9


def test_every_registered_architecture_reads_a_plain_config_into_layer_specs():
    for arch in ARCHITECTURES:
        keys = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32}  # fmt: skip
        c = config(arch, **keys)
        assert c.num_layers == len(c.layers) == 4 and all(
            isinstance(s, LayerSpec) for s in c.layers
        )
        assert weight_names(c) is ARCHITECTURES[arch].weights
    assert config("LlamaForCausalLM").layers == (LayerSpec(),) * 4  # the plain decoder


def test_gemma2_takes_transformers_defaults_for_absent_keys():
    c = config("Gemma2ForCausalLM", head_dim=16)
    assert [s.window for s in c.layers] == [4096, None, 4096, None]  # sliding, full, ...
    assert {s.soft_cap for s in c.layers} == {50.0} and c.final_softcap == 30.0
    assert all(s.norms == SANDWICH and s.activation == "gelu_tanh" for s in c.layers)
    assert c.tie_word_embeddings and c.scale_embeddings and weight_names(c).norm_offset == 1.0
    assert c.attn_scale == 256**-0.5  # query_pre_attn_scalar's default
    assert config("Gemma2ForCausalLM", final_logit_softcapping=None).final_softcap is None


def test_gemma3_old_spelling_gives_local_layers_their_own_rope():
    c = config("Gemma3ForCausalLM", rope_theta=1e6, rope_local_base_freq=1e4,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=2)  # fmt: skip
    assert [s.window for s in c.layers] == [4096, None, 4096, None]
    assert [s.local_rope for s in c.layers] == [True, False, True, False]  # sliding ones
    assert all(s.qk_norm and s.soft_cap is None for s in c.layers)
    assert (c.rope_theta, c.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (c.local_rope_theta, c.local_rope_scaling) == (1e4, None)
    assert c.kv_window is None  # a global layer reads everything: nothing is handed on


def test_qwen_windows_start_at_max_window_layers():
    c = config("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert [s.window for s in c.layers] == [None, None, 32, 32]
    assert config("Qwen3ForCausalLM", sliding_window=32).kv_window is None  # not used


def test_qwen3_moe_dense_layers_and_routing_flags():
    c = config("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3])  # fmt: skip
    assert [s.mlp for s in c.layers] == [DENSE, MOE, DENSE, DENSE]
    assert not c.experts.renormalize  # Qwen3-MoE's default
    mixtral = config("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2)
    assert mixtral.experts.renormalize and mixtral.experts.intermediate_size == 128
    assert {s.mlp for s in mixtral.layers} == {MOE}


def phi3(**rope_scaling) -> ModelConfig:
    """Phi-3 with 3/4 of each 16-wide head rotated (6 factors), 512 positions
    stretched to 4096."""
    scaling = {"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6, **rope_scaling}
    scaling = {k: v for k, v in scaling.items() if v is not None}
    return config("Phi3ForCausalLM", max_position_embeddings=4096,
                  original_max_position_embeddings=512, partial_rotary_factor=0.75,
                  rope_scaling=scaling)  # fmt: skip


def test_phi3_longrope_partial_rotary_and_the_context_it_is_served_at():
    c = phi3()
    assert c.rotary_dim == 12 and c.rope_dim == 12
    assert c.rope_scaling["rope_type"] == "longrope" and c.rope_scaling["factor"] == 8.0
    assert c.rope_scaling["long_factor"] == [2.0] * 6
    assert c.max_model_len == 4096  # past the original 512: with the long factors
    assert (
        config("MistralForCausalLM", sliding_window=16, max_position_embeddings=4096).max_model_len
        == 4096
    )


def test_longrope_without_long_factors_is_served_when_it_never_needs_them():
    c = config("Phi3ForCausalLM", max_position_embeddings=512, original_max_position_embeddings=512,
               rope_scaling={"type": "longrope", "short_factor": [1.0] * 8})  # fmt: skip
    assert c.max_model_len == 512 and "long_factor" not in c.rope_scaling


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"long_factor": None},
         r"needs a 'long_factor' list to serve past original_max_position_embeddings \(512\), "
         r"up to max_position_embeddings \(4096\)"),
        ({"short_factor": None}, "needs a 'short_factor' list"),
        ({"long_factor": [2.0] * 8}, "'long_factor' has 8 values; it needs 6, one per pair of "
                                     "the 12 rotated dimensions"),
        ({"short_factor": [1.0] * 5}, "'short_factor' has 5 values; it needs 6"),
        ({"long_factor": "2.0"}, "'long_factor' must be a list of positive numbers, got '2.0'"),
        ({"long_factor": [2.0] * 5 + [True]}, "'long_factor' must be a list of positive numbers"),
        ({"long_factor": [2.0] * 5 + [0.0]}, "'long_factor' must be a list of positive numbers"),
    ],
)  # fmt: skip
def test_longrope_factor_lists_are_refused_with_their_key(keys, message):
    with pytest.raises(CheckpointError, match=message):
        phi3(**keys)


@pytest.mark.parametrize(
    ("arch", "keys", "message"),
    [
        ("Gemma3ForCausalLM", {"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping' is 50.0"),
        ("Gemma2ForCausalLM", {"use_bidirectional_attention": True},
         "'use_bidirectional_attention' is True"),
        ("Gemma2ForCausalLM", {"hidden_activation": "gelu"}, "'hidden_activation' is 'gelu'"),
        ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 8, "shared_expert_intermediate_size": 64},
         "'shared_expert_intermediate_size' is 64"),
        ("MixtralForCausalLM", {"num_local_experts": 2, "num_experts_per_tok": 4},
         "'num_experts_per_tok' is 4; more than the 2 experts"),
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "layer_types": ["chunked_attention"] * 4},
         "'layer_types' is 'chunked_attention'"),
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "layer_types": [FULL]},
         "'layer_types' is .* one entry per layer"),
        ("Phi3ForCausalLM", {"partial_rotary_factor": 0.2}, "'partial_rotary_factor' is 0.2"),
        ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
         "unsupported rope type 'dynamic'"),
    ],
)  # fmt: skip
def test_what_is_not_computed_is_refused_with_its_key(arch, keys, message):
    with pytest.raises(CheckpointError, match=message):
        config(arch, **keys)
