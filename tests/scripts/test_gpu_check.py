"""scripts/gpu_check.py in its --smoke mode: the whole device check on the CPU,
Triton interpreted, tiny shapes, with nothing importable but torch, triton and
the standard library (what the device image is promised to have)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

# Imports made from the checkout's code fail for anything outside torch, triton
# and the standard library (torch and triton may still probe optional packages).
RUN_BLOCKED = textwrap.dedent(
    """
    import builtins, runpy, sys
    BLOCKED = {"numpy", "msgpack", "safetensors", "ray", "transformers", "tokenizers",
               "jinja2", "fastapi", "yaml", "prometheus_client", "httpx"}
    real_import = builtins.__import__

    def guarded(name, globals=None, locals=None, fromlist=(), level=0):
        caller = (globals or {}).get("__name__", "")
        ours = caller == "__main__" or caller.startswith("iterserve")
        if level == 0 and ours and name.split(".")[0] in BLOCKED:
            raise ImportError(f"{caller} imports {name}, which the device image may lack")
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = guarded
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


def test_smoke_run_passes_and_reports_every_section(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, "-c", RUN_BLOCKED, str(ROOT / "scripts" / "gpu_check.py"), "--smoke",
         "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == []
    assert report["device"]["copy_ceiling_gbps"] > 0
    checks = report["kernels"]
    assert all(v["ok"] for v in checks.values())
    for name in ("attention_decode_b4_split3", "attention_decode_wide_table", "attention_mixed",
                 "rms_norm", "silu_mul", "rotary", "store_kv"):  # fmt: skip
        assert f"{name}_float16" in checks and f"{name}_float32" in checks
    assert len(report["attention"]["grid"]) == 2
    model = report["model"]
    for key in ("prefill_logits_triton_vs_torch", "decode_logits_triton_vs_torch",
                "decode_logits_graph_vs_eager"):  # fmt: skip
        assert model[key]["ok"]
    assert model["decode_step_replayed"] and model["graph_replays"] > 0
    assert {row["batch"] for row in model["decode"]} == {1, 4}
    assert any(k.startswith("build_batch_ms") for k in report["host"])
