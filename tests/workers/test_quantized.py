"""Quantized checkpoints load and compute what their formats define.

Each checkpoint is written offline from a tiny random model by rounding to nearest
(:mod:`iterserve.workers.quant.write`), in every format served. Tolerances:

- weight-only formats (W4A16, W8A16, GPTQ, AWQ, FP8 on a CPU) in fp32 against
  transformers running the dense weights they stand for (dequantized by
  ``compressed-tensors`` or by this suite's own bit-by-bit unpacking): the same
  products in fp32, so logits within 1e-4, as the dense checkpoints' tests;
- W8A8 int8 in fp32 against transformers loading the checkpoint itself
  (compressed-tensors quantizes each product's rows): the rows are quantized
  alike, but a row whose value sits within a rounding of a half step after the
  layers before it (sums in another order) lands on the next integer, so the
  logits agree within 3% (relative, over all rows) and the top token of at least
  95% of the rows (a near-tie of the random models may go the other way).
"""

from __future__ import annotations

import json

import pytest
import torch
from quant_checkpoints import dense_reference
from test_model_logits import forward_all_rows
from tiny_checkpoints import build_hf_model, save

from iterserve.workers import ModelRunner
from iterserve.workers.config import CheckpointError
from iterserve.workers.quant.write import quantize_checkpoint

# The Llama wider than the other tiny models: several 32-output panels a product.
WIDER = {"llama": {"hidden_size": 128, "intermediate_size": 256}}
WEIGHT_ONLY = ["w4a16", "w4a16-asym", "w8a16", "fp8", "gptq", "gptq-8bit", "awq"]
LENGTHS = (1, 5, 40)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    def make(arch: str):
        model = build_hf_model(arch, **WIDER.get(arch, {}))
        return save(model, tmp_path_factory.mktemp(f"{arch}-dense"))

    cache: dict[str, object] = {}
    return lambda arch: cache.setdefault(arch, make(arch))


@pytest.fixture(scope="module")
def quantized_dir(dense_dir, tmp_path_factory):
    cache: dict[tuple, object] = {}

    def get(arch: str, scheme: str, **kw):
        key = (arch, scheme, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = quantize_checkpoint(dense_dir(arch), tmp_path_factory.mktemp(scheme),
                                             scheme, group_size=32, **kw)  # fmt: skip
        return cache[key]

    return get


def _prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]


def _logits(path, **kw):
    runner = ModelRunner(path, num_kv_blocks=64, block_size=8, dtype="float32", **kw)
    ps = _prompts()
    return forward_all_rows(runner, [[(0, len(p))] for p in ps], ps)


def _transformers_logits(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in _prompts()]


@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_weight_only_formats_match_their_dense_weights(scheme, backend, dense_dir, quantized_dir,
                                                        tmp_path):  # fmt: skip
    if scheme.startswith("w") or scheme == "fp8":
        pytest.importorskip("compressed_tensors")
    kw = {"desc_act": True} if scheme.startswith("gptq") else {}
    path = quantized_dir("llama", scheme, **kw)
    reference = dense_reference(path, dense_dir("llama"), tmp_path / "reference")
    want = _transformers_logits(reference)
    for got, expected in zip(_logits(path, kernel_backend=backend), want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def _close_w8a8(got, expected) -> None:
    assert (got - expected).norm() / expected.norm() < 0.03
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_w8a8_matches_transformers_loading_the_checkpoint(arch, quantized_dir):
    pytest.importorskip("compressed_tensors")
    path = quantized_dir(arch, "w8a8")
    want = _transformers_logits(path)
    for got, expected in zip(_logits(path, max_model_len=256), want, strict=True):
        _close_w8a8(got, expected)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_w8a8_experts_match_the_reference_products(arch, quantized_dir):
    """transformers keeps experts in one tensor, which compressed-tensors does not
    quantize: the experts' int8 kernels against the torch references' products."""
    path = quantized_dir(arch, "w8a8")
    want = _logits(path, kernel_backend="torch")
    for got, expected in zip(_logits(path, kernel_backend="cpu"), want, strict=True):
        _close_w8a8(got, expected)


@pytest.mark.parametrize("arch", ["qwen2", "phi3", "qwen3_moe", "mixtral"])
def test_every_architecture_loads_weight_only(arch, dense_dir, quantized_dir, tmp_path):
    """Biases (Qwen2), fused q/k/v and gate/up tensors (Phi-3), experts (Qwen3-MoE,
    Mixtral): GPTQ with desc_act, each against its dense weights."""
    path = quantized_dir(arch, "gptq", desc_act=True)
    reference = dense_reference(path, dense_dir(arch), tmp_path / "reference")
    want = _transformers_logits(reference)
    for got, expected in zip(_logits(path, max_model_len=256), want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_fp8_on_a_dense_checkpoint_quantizes_at_load(dense_dir):
    """``quantization: fp8`` on a dense checkpoint: e4m3 weights, one scale an output,
    within fp8's rounding (3 bits of fraction) of the dense model."""
    path = dense_dir("llama")
    dense = _logits(path)
    fp8 = _logits(path, quantization="fp8")
    for got, want in zip(fp8, dense, strict=True):
        assert 1e-4 < (got - want).norm() / want.norm() < 0.1


def _edit(path, tmp_path, change) -> object:
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(path, copy)
    change(copy)
    return copy


def _edit_config(copy, **quantization):
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"].update(quantization)
    (copy / "config.json").write_text(json.dumps(config))


def _edit_group(copy, **changes):
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"].update(changes)
    (copy / "config.json").write_text(json.dumps(config))


def _edit_tensor(copy, name, value):
    from safetensors.torch import load_file, save_file

    tensors = load_file(copy / "model.safetensors")
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value(tensors[name])
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "scheme, kw, change, message",
    [
        (
            "w8a8",
            {},
            lambda c: _edit_tensor(
                c, "model.layers.1.mlp.down_proj.weight_scale", lambda t: t * float("nan")
            ),
            "model.layers.1.mlp.down_proj's scales hold a value that is not finite",
        ),
        (
            "w4a16",
            {},
            lambda c: _edit_tensor(c, "model.layers.0.self_attn.k_proj.weight_scale", lambda t: -t),
            "model.layers.0.self_attn.k_proj's scales hold a value that is not finite and positive",
        ),
        (
            "gptq",
            {"desc_act": True},
            lambda c: _edit_tensor(c, "model.layers.0.mlp.up_proj.g_idx", None),
            "model.layers.0.mlp.up_proj.g_idx is missing",
        ),
        (
            "w4a16",
            {},
            lambda c: _edit_config(
                c,
                config_groups={
                    "group_0": {
                        "targets": ["Linear"],
                        "format": "pack-quantized",
                        "weights": {
                            "num_bits": 4,
                            "type": "int",
                            "strategy": "group",
                            "group_size": 64,
                            "symmetric": True,
                        },
                    }
                },
            ),
            "model.layers.0.self_attn.q_proj.weight_scale has shape (64, 4), expected (64, 2): "
            "groups of 64",
        ),
        (
            "awq",
            {},
            lambda c: _edit_config(c, version="gemv"),
            "quantization_config.version is 'gemv'; served: gemm",
        ),
        (
            "gptq",
            {},
            lambda c: _edit_config(c, bits=3),
            "quantization_config.bits is 3; served: 4, 8",
        ),
        (
            "w8a8",
            {},
            lambda c: _edit_config(c, quant_method="bitsandbytes"),
            "quantization_config.quant_method is 'bitsandbytes'; served: compressed-tensors",
        ),
        (
            "w4a16",
            {},
            lambda c: _edit_group(c, format="marlin-24"),
            "quantization_config.config_groups.group_0.format is 'marlin-24'",
        ),
        (
            "w8a8",
            {},
            lambda c: _edit_group(c, output_activations={"num_bits": 8}),
            "quantization_config.config_groups.group_0.output_activations is {'num_bits': 8}",
        ),
    ],
)
def test_a_bad_checkpoint_is_refused_naming_the_key_or_tensor(scheme, kw, change, message,
                                                               quantized_dir, tmp_path):  # fmt: skip
    path = _edit(quantized_dir("llama", scheme, **kw), tmp_path, change)
    with pytest.raises(CheckpointError) as refused:
        ModelRunner(path, num_kv_blocks=8, block_size=8, dtype="float32")
    assert message in str(refused.value)


def test_the_quantization_knob_must_match_the_checkpoint(quantized_dir, dense_dir):
    with pytest.raises(
        ValueError,
        match="quantization: 'gptq', but the checkpoint's "
        "quantization_config says 'compressed-tensors'",
    ):
        ModelRunner(quantized_dir("llama", "w8a8"), num_kv_blocks=8, quantization="gptq")
    with pytest.raises(
        ValueError, match="quantization: 'awq', but the checkpoint has no quantization_config"
    ):
        ModelRunner(dense_dir("llama"), num_kv_blocks=8, quantization="awq")
