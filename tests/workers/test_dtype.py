"""What ``dtype: auto`` picks on each kind of device and CPU (the instruction-set
level faked), by a rule where one holds and by measuring the model's own products
where none does, why it says it did, and that a configured dtype is taken as it is."""

import pytest
import torch

from iterserve.kernels.cpu import isa
from iterserve.workers import dtype
from iterserve.workers.dtype import DtypeError, RuntimeChoices, choose_dtype


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    monkeypatch.setattr(dtype, "_compiled_kernels", lambda: True)


def never_measured():
    raise AssertionError("a rule decides here: nothing is measured")


def test_auto_is_bf16_with_amx_by_rule():
    for saved in ("float32", "bfloat16", "float16", None):
        choice = choose_dtype("auto", saved, "cpu", level="amx", measure=never_measured)
        assert choice.dtype == torch.bfloat16 and choice.name == "bfloat16"
        assert "AMX" in choice.reason and choice.reason.startswith("auto")


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512"])
def test_auto_is_fp32_without_a_bf16_dot_product_by_rule(level):
    choice = choose_dtype("auto", "bfloat16", "cpu", level=level, measure=never_measured)
    assert choice.dtype == torch.float32
    assert level in choice.reason and "no bf16 dot product" in choice.reason


@pytest.mark.parametrize(
    "ratio, want", [(0.5, torch.bfloat16), (0.85, torch.bfloat16), (0.9, torch.float32),
                    (1.3, torch.float32)],
)  # fmt: skip
def test_auto_measures_where_no_rule_decides(ratio, want):
    """avx512_bf16 without AMX: the model's bf16 products against its fp32 ones,
    bf16 only where clearly the faster (a near tie stays fp32, the exacter)."""
    asked = []
    choice = choose_dtype("auto", "float32", "cpu", level="avx512_bf16",
                          measure=lambda: asked.append(1) or ratio)  # fmt: skip
    assert asked == [1] and choice.dtype == want
    assert "measured at load" in choice.reason and f"{ratio:.2f}x" in choice.reason


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_auto_is_fp32_where_the_compiled_cpu_kernels_do_not_run(backend):
    """The torch references convert every bf16 tensor to fp32 and back: slower."""
    assert choose_dtype("auto", "bfloat16", "cpu", backend, level="amx").dtype == torch.float32
    assert choose_dtype("auto", "bfloat16", "cpu", "cpu", level="amx").dtype == torch.bfloat16


def test_auto_is_fp32_when_numba_is_missing(monkeypatch):
    monkeypatch.setattr(dtype, "_compiled_kernels", lambda: False)
    assert choose_dtype("auto", "bfloat16", "cpu", level="amx").dtype == torch.float32


def test_auto_on_an_accelerator_is_the_checkpoint_s_dtype():
    assert choose_dtype("auto", "bfloat16", "cuda", level="amx").dtype == torch.bfloat16
    assert choose_dtype("auto", "float16", "cuda:1").dtype == torch.float16
    assert choose_dtype("auto", "torch.float32", "cuda").dtype == torch.float32
    unnamed = choose_dtype("auto", None, "cuda")
    assert unnamed.dtype == torch.float32 and "names no dtype" in unnamed.reason


def test_a_configured_dtype_is_taken_on_any_device():
    for name, want in (("float16", torch.float16), ("bf16", torch.bfloat16),
                       ("float32", torch.float32)):  # fmt: skip
        for device in ("cpu", "cuda"):
            choice = choose_dtype(name, "float32", device, level="avx2", measure=never_measured)
            assert choice.dtype == want and choice.reason == "configured"
    assert choose_dtype(torch.bfloat16, None, "cpu").dtype == torch.bfloat16


@pytest.mark.parametrize("bad", ["int8", "fp8", ""])
def test_an_unknown_dtype_is_refused_by_name(bad):
    with pytest.raises(DtypeError, match=f"unsupported dtype {bad!r}"):
        choose_dtype(bad, None, "cpu")


def test_the_measurement_times_both_dtypes_on_the_model_s_shapes(monkeypatch):
    """The products of a layer's shapes in both dtypes, through the kernels a step
    runs; the ratio of the summed medians (faked clock: bf16 costs half)."""
    from iterserve.kernels.cpu import linear

    clock, seen = [0.0], set()

    def product(x, weight, bias=None, packed=None):
        seen.add((weight.dtype, tuple(weight.shape), x.shape[0]))
        clock[0] += 0.5 if weight.dtype == torch.bfloat16 else 1.0

    monkeypatch.setattr(linear, "linear", product)
    monkeypatch.setattr(dtype.time, "thread_time", lambda: clock[0])
    monkeypatch.setattr(dtype, "MEASURED_BYTES", 1)
    shapes = [(96, 64), (64, 32)]
    assert dtype.measure_products(shapes, rows=(4, 8)) == pytest.approx(0.5)
    assert seen == {(dt, s, n) for dt in (torch.float32, torch.bfloat16) for s in shapes
                    for n in (4, 8)}  # fmt: skip


def test_the_model_s_product_shapes_follow_its_config_and_split():
    from iterserve.workers.config import LayerSpec, ModelConfig

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64,
                         intermediate_size=128, num_heads=8, num_kv_heads=2, head_dim=8,
                         rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                         layers=(LayerSpec(),))  # fmt: skip
    assert dtype.product_shapes(config) == [(96, 64), (64, 64), (256, 64), (64, 128), (100, 64)]
    assert dtype.product_shapes(config, tp_size=2)[:4] == [(48, 64), (64, 32), (128, 64),
                                                           (64, 64)]  # fmt: skip


def test_runtime_choices_cross_as_a_dict():
    choices = RuntimeChoices("bfloat16", "auto: AMX multiplies bf16 tiles", "amx",
                             ((5632, 1024),))  # fmt: skip
    again = RuntimeChoices.from_dict(choices.to_dict())
    assert again == choices and again.torch_dtype == torch.bfloat16
    assert again.pads_cliff(torch.Size([5632, 1024])) and not again.pads_cliff((1024, 1024))


def test_this_machine_s_level_is_a_known_one():
    assert isa.level() in isa.LEVELS


def test_a_small_model_gets_a_larger_cpu_step_budget():
    """About the cost of a 144M model's 512 tokens a step, in 512s, up to 2048."""
    from iterserve.cluster.ranks.executors import cpu_step_tokens
    from iterserve.models import DEMO_MODEL_PATH
    from iterserve.workers.checkpoint import load_checkpoint
    from iterserve.workers.config import LayerSpec, ModelConfig

    assert cpu_step_tokens(load_checkpoint(DEMO_MODEL_PATH).config) == 2048
    llama_144m = ModelConfig(architecture="LlamaForCausalLM", vocab_size=4096, hidden_size=1024,
                             intermediate_size=2816, num_heads=16, num_kv_heads=4, head_dim=64,
                             rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=2048,
                             layers=(LayerSpec(),) * 12)  # fmt: skip
    assert cpu_step_tokens(llama_144m) == 512
