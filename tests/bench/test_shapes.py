"""Random-weight checkpoints of named shapes: the same seed writes the same weights,
the runtime loads them in either dtype, and a bad name is refused naming the known
ones. Also the greedy-agreement benchmark's arithmetic."""

import json

import pytest
import torch
from safetensors.torch import load_file

from iterserve.bench import agreement, shapes
from iterserve.workers.runner import ModelRunner

TINY = ("a tiny Llama for tests", {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "tie_word_embeddings": False, "max_position_embeddings": 256,
})  # fmt: skip


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(shapes.SHAPES, "tiny", TINY)
    return "tiny"


def test_a_shape_is_written_alike_from_the_same_seed_and_differently_from_another(
    tiny_shape, tmp_path
):
    a = shapes.build_checkpoint(tiny_shape, tmp_path / "a", dtype="float32", seed=1)
    b = shapes.build_checkpoint(tiny_shape, tmp_path / "b", dtype="float32", seed=1)
    c = shapes.build_checkpoint(tiny_shape, tmp_path / "c", dtype="float32", seed=2)
    ta, tb, tc = (load_file(str(p / "model.safetensors")) for p in (a, b, c))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not torch.equal(ta["lm_head.weight"], tc["lm_head.weight"])
    config = json.loads((a / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["vocab_size"] == 4096  # the demo tokenizer's
    assert (a / "tokenizer.json").exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_runtime_loads_a_shape_in_its_dtype(tiny_shape, tmp_path, dtype):
    path = shapes.build_checkpoint(tiny_shape, tmp_path / "tiny", dtype=dtype)
    runner = ModelRunner(path, dtype="auto", num_kv_blocks=8, device="cpu", kernel_backend="torch")
    assert runner.config.num_layers == 2 and runner.vocab_size == 4096
    weights = load_file(str(path / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].dtype == getattr(torch, dtype)


@pytest.mark.parametrize(
    "scheme, method",
    [("w8a8", "compressed-tensors"), ("w4a16", "compressed-tensors"), ("awq", "awq")],
)
def test_a_shape_is_written_quantized_and_served_as_its_checkpoint_says(tiny_shape, tmp_path,
                                                                        scheme, method):  # fmt: skip
    """``bench checkpoint --quantize``: the dense shape's weights quantized, the
    tokenizer kept; the runtime reads the scheme from the checkpoint."""
    path = shapes.build_checkpoint(tiny_shape, tmp_path / "q", quantize=scheme, group_size=32)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == method
    assert (path / "tokenizer.json").exists()
    runner = ModelRunner(path, num_kv_blocks=8, device="cpu")
    assert runner.choices.quantization == method


def test_every_named_shape_is_a_config_transformers_accepts():
    import transformers

    for name, (what, fields) in shapes.SHAPES.items():
        fields = dict(fields)
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        assert config.hidden_size == fields["hidden_size"] and what, name


def test_every_named_shape_is_an_architecture_the_runtime_loads():
    """Each shape's config.json, as transformers writes it, is one the loader
    takes, with the architecture's features read (experts, windows, norms)."""
    import transformers

    from iterserve.workers.config import ModelConfig

    for name, (_, fields) in shapes.SHAPES.items():
        fields = dict(fields)
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        raw = {**config.to_dict(), "architectures": [_causal_lm(config)], "vocab_size": 4096}
        loaded = ModelConfig.from_dict(raw)
        assert loaded.hidden_size == fields["hidden_size"], name
        assert (loaded.experts is not None) == ("experts" in " ".join(fields)), name
    assert {"qwen3-144m", "gemma3-144m", "mixtral-144m", "qwen3-moe-144m"} <= shapes.SHAPES.keys()


def _causal_lm(config) -> str:
    import transformers

    return transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__


def test_an_unknown_shape_or_dtype_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="unknown shape 'llama-7x'.*llama-144m"):
        shapes.build_checkpoint("llama-7x", tmp_path)
    with pytest.raises(ValueError, match="dtype must be one of"):
        shapes.build_checkpoint("llama-144m", tmp_path, dtype="int8")


def test_agreement_counts_identical_sequences_and_first_differences():
    a = [[1, 2, 3], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    b = [[1, 2, 3], [1, 9, 3], [0, 5, 6], [7, 8, 0]]
    got = agreement.agreement(a, b)
    assert got["identical"] == 0.25 and got["first_token_agrees"] == 0.75
    assert got["mean_first_difference"] == round((3 + 1 + 0 + 2) / 4, 1)


def test_agreement_prompts_come_from_the_standard_library_and_are_stable():
    first, again = agreement.stdlib_prompts(12), agreement.stdlib_prompts(12)
    assert len(first) == 12 and first == again
    assert all(20 <= len(p) <= 120 for p in first)
