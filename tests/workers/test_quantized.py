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


def test_the_knobs_choices_are_the_methods_served():
    from iterserve.cluster.config import QUANTIZATIONS
    from iterserve.workers import quant

    assert QUANTIZATIONS == quant.CHOICES


def test_quantized_weights_off_a_cpu_run_only_the_references(quantized_dir):
    """No GPU kernel computes them yet: refused by name at the engine's first
    choice, unless the torch references are asked for."""
    from iterserve.workers import quant
    from iterserve.workers.checkpoint import load_checkpoint
    from iterserve.workers.dtype import DtypeError, decide

    ckpt = load_checkpoint(quantized_dir("llama", "awq"))
    config = quant.resolve(None, ckpt.quantization)
    with pytest.raises(DtypeError, match="quantization 'awq' on cuda: no GPU kernel"):
        decide(ckpt.config, "float16", None, "cuda", quantized=config)
    choices = decide(ckpt.config, "float16", None, "cuda", "torch", quantized=config)
    assert choices.quantization == "awq"
    ckpt.close()


@pytest.mark.parametrize("scheme", ["gptq", "w4a16", "fp8"])
def test_batch_invariant_refuses_weight_only_products(scheme, quantized_dir, dense_dir):
    """A weight-only product's float sums follow the batch where the reference runs
    (an fp32 engine's): refused by name, as is ``fp8`` at load."""
    from iterserve.workers.dtype import DtypeError

    path = quantized_dir("llama", scheme)
    method = json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"]
    with pytest.raises(DtypeError, match=f"batch_invariant with quantization '{method}'"):
        ModelRunner(path, num_kv_blocks=8, batch_invariant=True)
    with pytest.raises(DtypeError, match=r"batch_invariant with quantization 'fp8' \(fp8 \(quan"):
        ModelRunner(dense_dir("llama"), num_kv_blocks=8, batch_invariant=True,
                    quantization="fp8")  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_w8a8_under_batch_invariant_computes_every_row_as_alone(dtype, quantized_dir):
    """W8A8's int8 sums are exact and each row's activation scale its own: under
    ``batch_invariant`` a row's logits are the same bits alone and among 1-24 other
    rows of decodes and prefill pieces, its prompt cut into pieces, preempted and
    recomputed (the batch-invariance suite's scenarios, tests/workers/invariance.py)."""
    from invariance import Scenario, alone, differing, prompt_pool, run

    runner = ModelRunner(quantized_dir("llama", "w8a8"), dtype=dtype, num_kv_blocks=1024,
                         block_size=16, kernel_backend="cpu", batch_invariant=True)  # fmt: skip
    kinds = {p.kernel for layer in runner.model.layers
             for p in (layer.attn.qkv_packed, layer.attn.o_packed)}  # fmt: skip
    assert kinds <= {"amx_int8", "onednn_int8"}, kinds
    prompts = prompt_pool(runner.vocab_size, count=24)
    logits, tokens = alone(runner, prompts)
    steps = [(1.0, [1, 3, 16, 1 << 30], 0.15), (0.7, [2, 17, 64], 0.15), (1.0, [1 << 30], 0.0)]
    crowd = Scenario({label: i // 8 for i, label in enumerate(prompts)}, steps)
    got, got_tokens, stats = run(runner, prompts, crowd)
    assert stats["widest_step"] >= 24 and stats["mixed_steps"] and stats["preemptions"]
    assert differing(logits, got) == []
    assert got_tokens == {label: tokens[label] for label in got_tokens}


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, scheme, kw",
    [("llama", "gptq", {"desc_act": True}), ("qwen3_moe", "w4a16-asym", {}),
     ("phi3", "awq", {})],
)  # fmt: skip
def test_tp2_splits_quantized_weights_and_their_scales(arch, scheme, kw, quantized_dir, tmp_path):
    """Two ranks over gloo: q/k/v and gate/up split by rows with their scales and zero
    points (Phi-3's fused tensors by row ranges), o and down by inputs with every
    group's scales and each input's group (g_idx out of order, groups cut between
    ranks), experts alike. The tokens are TP=1's."""
    import torch.multiprocessing as mp
    from plan_driver import PlanDriver
    from test_runner_greedy import make_runner, prompts
    from test_tensor_parallel import free_port
    from tp_worker import run_rank

    path = quantized_dir(arch, scheme, **kw)
    context = 256 if arch == "phi3" else None
    driver = PlanDriver(make_runner(path, max_model_len=context))
    ps = prompts(4)
    for i, p in enumerate(ps):
        driver.add(f"g{i}", p)
    from iterserve.scheduler.sampling import SamplingParams

    driver.add("seeded", ps[0], SamplingParams(temperature=1.0, seed=3, max_tokens=16,
                                               ignore_eos=True))  # fmt: skip
    expected = driver.run(chunk=7)
    out_file = str(tmp_path / "tokens")
    mp.spawn(run_rank, args=(2, free_port(), str(path), ps, out_file, context), nprocs=2, join=True)
    for rank in range(2):
        with open(f"{out_file}.{rank}") as f:
            assert json.load(f) == expected


@pytest.mark.slow
def test_tp2_w8a8_ranks_quantize_their_own_inputs(dense_dir, quantized_dir, tmp_path):
    """W8A8 at TP=2: q/k/v and gate/up split by rows with their scales, o and down by
    inputs. A rank quantizes the inputs of its half of o and down per token over its
    own half (as vLLM's ranks do), so its rows round otherwise than TP=1's, and on
    the random tiny model near-ties then go either way (TP=2 and TP=1 pick the same
    top token in ~93% of the rows). So each is held to the dense model: TP=2's logits
    are no further from it than TP=1's (within 1.25x; a half's scale is at most the
    row's, so it rounds no coarser) and pick its top token in as many rows (within
    5% of them)."""
    import torch.multiprocessing as mp
    from test_tensor_parallel import free_port
    from tp_worker import run_logits_rank

    path = quantized_dir("llama", "w8a8")
    dense = torch.cat(_logits(dense_dir("llama"), kernel_backend="torch"))
    tp1 = torch.cat(_logits(path, kernel_backend="torch"))
    out_file = str(tmp_path / "logits")
    mp.spawn(run_logits_rank, args=(2, free_port(), str(path), _prompts(), out_file), nprocs=2,
             join=True)  # fmt: skip

    def error(logits):
        return (logits - dense).norm() / dense.norm()

    def agreement(logits):
        return (logits.argmax(-1) == dense.argmax(-1)).float().mean()

    for rank in range(2):
        tp2 = torch.cat(torch.load(f"{out_file}.{rank}"))
        assert error(tp2) <= 1.25 * error(tp1)
        assert agreement(tp2) >= agreement(tp1) - 0.05
