"""One table says which CPU kernel runs for an op, read for any instruction-set
level (a faked one here); one environment variable caps the level, and with it
oneDNN and numba's target."""

import json
import os
import subprocess
import sys

import pytest

from iterserve.kernels.cpu import dispatch, isa
from iterserve.kernels.cpu.dispatch import BF16, FP32, Dispatch

LLAMA = dispatch.model_traits(num_heads=16, num_kv_heads=4, head_dim=64, hidden_size=1024)


@pytest.mark.parametrize(
    "level, attention, long, linear, norm",
    [
        ("generic", "loops", "flash", "onednn", "loops"),
        ("avx2", "loops", "flash", "onednn", "loops"),
        ("avx512", "loops", "flash", "onednn", "tiles"),
        ("avx512_bf16", "tiles", "flash", "onednn", "tiles"),
        ("amx", "amx_tiles", "amx", "amx_rows", "tiles"),
    ],
)
def test_each_level_runs_the_kernels_its_instructions_allow(level, attention, long, linear, norm):
    kernels = Dispatch(level).describe(BF16, LLAMA)
    assert (kernels["attention.rows"], kernels["attention.long"]) == (attention, long)
    assert (kernels["linear"], kernels["rms_norm"]) == (linear, norm)


@pytest.mark.parametrize("level", isa.LEVELS)
def test_fp32_runs_the_loops_and_onednn_everywhere(level):
    kernels = Dispatch(level).describe(FP32, LLAMA)
    assert kernels["attention.rows"] == "loops" and kernels["attention.long"] == "flash"
    assert kernels["linear"] == "onednn" and kernels["silu_mul"] == "torch"
    assert Dispatch(level).kernel("linear", FP32, frozenset({"few"})) == "plain"


@pytest.mark.parametrize("level", isa.LEVELS)
def test_every_op_finds_a_kernel_for_any_call(level):
    """Each op's last row takes any call of its dtypes, whatever its traits."""
    table = Dispatch(level)
    for op in dispatch.OPS:
        for dtype in (FP32, BF16):
            assert table.kernel(op, dtype, frozenset()) in {r.kernel for r in dispatch.TABLE}


def test_shape_classes_steer_the_choice():
    amx = Dispatch("amx")
    odd_group = dispatch.row_traits(num_heads=12, num_kv_heads=4, head_dim=64, block_size=16)
    assert amx.kernel("attention.rows", BF16, odd_group) == "tiles"  # 3 heads a group
    odd_head = dispatch.row_traits(num_heads=8, num_kv_heads=2, head_dim=80, block_size=16)
    assert amx.kernel("attention.rows", BF16, odd_head) == "loops"
    capped = dispatch.long_traits(head_dim=64, window_cuts=False, soft_cap=50.0)
    assert amx.kernel("attention.long", BF16, capped) == "reference"
    cut = dispatch.long_traits(head_dim=64, window_cuts=True, soft_cap=None)
    assert amx.kernel("attention.long", FP32, cut) == "reference"
    assert amx.kernel("linear", BF16, frozenset()) == "onednn"  # a prefill's rows


def test_every_row_that_beats_the_one_below_says_why():
    for rule in dispatch.TABLE:
        if rule.traits or rule.level != "generic":
            assert rule.why, rule


def test_fp16_is_the_references_everywhere():
    assert set(Dispatch("amx").describe("float16", LLAMA).values()) == {"reference"}


def test_an_unknown_level_is_refused_by_name():
    with pytest.raises(isa.IsaError, match="avx9"):
        Dispatch("avx9")


def test_levels_are_read_off_llvm_s_feature_names():
    have = {f: True for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512bf16")}
    assert isa.level_of(have) == "avx512_bf16"
    assert isa.level_of({**have, "amx-tile": True, "amx-bf16": True}) == "amx"
    assert isa.level_of({"avx2": True}) == "generic"  # no FMA
    assert isa.level_of({}) == "generic"


def test_numba_compiles_for_the_features_of_the_capped_level():
    host = {"avx2": True, "fma": True, "avx512f": True, "avx512bw": True, "avx512vl": True,
            "avx512bf16": True, "avx512vnni": True, "amx-tile": True, "amx-bf16": True,
            "avx10.1-512": True, "sse4.2": True}  # fmt: skip
    avx2 = isa.numba_features(host, "avx2").split(",")
    assert "+avx2" in avx2 and "+sse4.2" in avx2 and "-prefer-256-bit" not in avx2
    assert {"-avx512f", "-avx512bf16", "-avx512vnni", "-amx-tile", "-avx10.1-512"} <= set(avx2)
    bf16 = isa.numba_features(host, "avx512_bf16").split(",")
    assert {"+avx512f", "+avx512bf16", "-amx-tile", "-amx-bf16", "-prefer-256-bit"} <= set(bf16)


def _probe(level: str) -> dict:
    """What a fresh process capped at ``level`` sees."""
    code = (
        "import json, os, numba\n"
        "from iterserve.kernels.cpu import isa, dispatch, tiles, amx\n"
        "print(json.dumps({'level': isa.level(), 'describe': isa.describe(),\n"
        "  'onednn': os.environ.get('ONEDNN_MAX_CPU_ISA'), 'features': numba.config.CPU_FEATURES,\n"
        "  'tiles': tiles.available(), 'amx': amx.available()}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA",
                                                            "NUMBA_CPU_FEATURES")}  # fmt: skip
    env["ITERSERVE_CPU_ISA"] = level
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not isa.at_least(isa.hardware(), "avx512_bf16"), reason="nothing to cap")
def test_the_environment_caps_oneDNN_numba_and_the_tables():
    seen = _probe("avx2")
    assert seen["level"] == "avx2" and "ITERSERVE_CPU_ISA=avx2" in seen["describe"]
    assert seen["onednn"] == "AVX2"
    assert "-avx512f" in seen["features"].split(",")
    assert not seen["tiles"] and not seen["amx"]
    seen = _probe("avx512_bf16")
    assert seen["onednn"] == "AVX512_CORE_BF16" and seen["tiles"] and not seen["amx"]


def test_a_bad_cap_is_refused_naming_the_variable():
    env = {**os.environ, "ITERSERVE_CPU_ISA": "avx9"}
    out = subprocess.run([sys.executable, "-c", "import iterserve.kernels"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0 and "ITERSERVE_CPU_ISA='avx9'" in out.stderr
