"""Argument checks (same ValueError from both backends) and backend selection."""

import subprocess
import sys

import pytest
import torch

from iterserve.kernels import KernelOps, build_cos_sin_cache, get_ops

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "cpu", "triton"]


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def idx(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def attention_args(**override):
    args = dict(
        query=t(3, 4, 64),
        k_cache=t(4, 16, 2, 64),
        v_cache=t(4, 16, 2, 64),
        block_tables=torch.zeros(2, 2, dtype=torch.int32, device=DEVICE),
        seq_lens=idx(5, 2),
        query_start_loc=idx(0, 1, 3),
        scale=0.125,
    )
    args.update(override)
    return args


ATTENTION_CASES = {
    "query": dict(query=t(3, 4, 32)),  # head_dim differs from the cache's
    "query ": dict(query=t(3, 3, 64)),  # 3 heads is not a multiple of 2 kv heads
    "query  ": dict(query=t(3, 4, 64, dtype=torch.int32)),
    "k_cache": dict(k_cache=t(4, 16, 2, 64, dtype=torch.float16)),
    "k_cache ": dict(k_cache=t(4, 16, 2, 64).transpose(1, 2)),  # not contiguous
    "v_cache": dict(v_cache=t(4, 16, 2, 32)),
    "block_tables": dict(block_tables=torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)),
    "block_tables ": dict(block_tables=torch.zeros(2, 2, device=DEVICE)),  # float
    "seq_lens": dict(seq_lens=idx(5, 2).float()),
    "query_start_loc": dict(query_start_loc=idx(0, 3)),
    "scale": dict(scale=-1.0),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_paged_attention_rejects(backend, name):
    ops = get_ops(backend)
    with pytest.raises(ValueError, match=name.strip()):
        ops.paged_attention(**attention_args(**ATTENTION_CASES[name]))


STORE_CASES = {
    "value": dict(value=t(3, 2, 32)),
    "k_cache": dict(k_cache=t(4, 16, 4, 64)),
    "v_cache": dict(v_cache=t(4, 16, 2, 64, dtype=torch.float16)),
    "slot_mapping": dict(slot_mapping=idx(0, 1)),
    "slot_mapping ": dict(slot_mapping=idx(0, 1, 2).float()),
    "key": dict(key=t(3, 2, 64, dtype=torch.float16)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(STORE_CASES))
def test_store_kv_rejects(backend, name):
    args = dict(
        key=t(3, 2, 64),
        value=t(3, 2, 64),
        k_cache=t(4, 16, 2, 64),
        v_cache=t(4, 16, 2, 64),
        slot_mapping=idx(0, 1, 2, dtype=torch.int64),
    )
    args.update(STORE_CASES[name])
    with pytest.raises(ValueError, match=name.strip()):
        get_ops(backend).store_kv(**args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_ops_reject(backend):
    ops = get_ops(backend)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(t(2, 8), t(9), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm(t(2, 8), t(8), 1e-6, residual=t(3, 8))
    with pytest.raises(ValueError, match="^x "):
        ops.rms_norm(t(2, 8).t(), t(2), 1e-6)  # last dim not contiguous
    with pytest.raises(ValueError, match="^x "):
        ops.silu_mul(t(2, 7))
    with pytest.raises(ValueError, match="^x "):
        ops.silu_mul(t(2, 8, dtype=torch.int64))
    cache = build_cos_sin_cache(64, 8, 10000.0).to(DEVICE)
    pos = idx(0, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="key"):
        ops.rotary_embedding(pos, t(2, 4, 64), t(2, 2, 32), cache)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        ops.rotary_embedding(pos, t(2, 4, 32), t(2, 2, 32), cache)
    with pytest.raises(ValueError, match="positions"):
        ops.rotary_embedding(pos.float(), t(2, 4, 64), t(2, 2, 64), cache)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU tensors outside the interpreter")
def test_triton_backend_rejects_cpu_tensors_when_compiled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        get_ops("triton").silu_mul(t(2, 8))


def test_get_ops_selects_backend():
    assert isinstance(get_ops("torch"), KernelOps)
    assert get_ops("torch").name == "torch"
    assert get_ops("triton").name == "triton"
    assert get_ops("auto", device="cpu").name == "cpu"  # numba is a dependency
    assert get_ops("auto", device=torch.device("cuda", 0)).name == "triton"
    assert get_ops("auto").name == ("triton" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="backend"):
        get_ops("cuda")
    ops = get_ops("torch")
    with pytest.raises(AttributeError):
        ops.name = "other"  # frozen


def test_cpu_backend_does_not_import_triton():
    code = (
        "import sys, torch\n"
        "from iterserve.kernels import get_ops\n"
        "ops = get_ops('auto', device='cpu')\n"
        "x = torch.randn(2, 8)\n"
        "ops.silu_mul(x); ops.rms_norm(x, torch.ones(8), 1e-6)\n"
        "assert ops.name == 'cpu'\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
