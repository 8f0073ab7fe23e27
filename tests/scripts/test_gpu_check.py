"""scripts/gpu_check.py in its --smoke mode: the whole device check on the CPU,
Triton interpreted, tiny shapes, with nothing importable but torch, triton and
the standard library (what the device image is promised to have); a run cut
short by its budget or killed; the compile section's report."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"

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
        ours = caller == "__main__" or caller.startswith(("iterserve", "gpu_check"))
        if level == 0 and ours and name.split(".")[0] in BLOCKED:
            raise ImportError(f"{caller} imports {name}, which the device image may lack")
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = guarded
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


def command(*args: str) -> list[str]:
    return [sys.executable, "-c", RUN_BLOCKED, str(SCRIPT), "--smoke", *args]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smoke")
    out = tmp / "check.json"
    proc = subprocess.run(command("--json", str(out)), cwd=tmp, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    return proc, json.loads(out.read_text()), tmp


def test_smoke_run_passes_and_reports_every_section(smoke):
    proc, report, tmp = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["failures"] == []
    assert report["status"] == "complete"
    # Nothing is skipped for time in smoke mode; compile is left to the suite.
    assert set(report["skipped"]) == {"compile"}
    assert report["device"]["copy_ceiling_gbps"] > 0
    checks = report["kernels"]
    assert all(v["ok"] for v in checks.values())
    for name in ("attention_decode_b4_split3", "attention_decode_wide_table", "attention_mixed",
                 "rms_norm", "silu_mul", "rotary", "store_kv"):  # fmt: skip
        assert f"{name}_float16" in checks and f"{name}_float32" in checks
    grid = report["attention"]["grid"]
    assert len(grid) == 2 and all(row["kv_caches"] == 2 for row in grid)
    model = report["model"]
    assert {row["batch"] for row in model["decode"]} == {1, 4}
    assert model["decode_step_replayed"] and model["graph_replays"] > 0
    # a batch-invariant engine: every row as alone, under pieces and a preemption
    for name in ("float32", "float16"):
        row = report["invariance"][name]
        assert row["rows_compared"] > 0 and row["rows_differing"] == 0 and row["tokens_equal"]
        assert row["preemptions"] and row["mixed_steps"]
    # the temporary files of the rewrites are all renamed away
    assert [p.name for p in tmp.iterdir()] == ["check.json"]


def test_triton_logits_are_held_to_the_torch_paths_error_against_fp32(smoke):
    _, report, _ = smoke
    model = report["model"]
    for key in ("prefill_logits_triton_vs_fp32", "decode_logits_triton_vs_fp32",
                "decode_logits_graph_vs_fp32"):  # fmt: skip
        check = model[key]
        assert check["ok"]
        # fp16 in smoke mode: the torch path has a real error to compare with
        assert check["torch_rel_err_vs_fp32"] > 1e-5
        assert check["limit"] == pytest.approx(1.5 * check["torch_rel_err_vs_fp32"] + 1e-4)
        assert check["rel_err_vs_fp32"] <= check["limit"] and check["margin"] >= 1
    layers = model["prefill_layers_triton_vs_fp32"]
    assert layers["ok"] and len(layers["triton_rel_err"]) == len(layers["torch_rel_err"]) == 2


def test_graph_replay_is_compared_with_its_own_bucket_and_split_plan(smoke):
    _, report, _ = smoke
    same = report["model"]["decode_logits_graph_vs_eager_same_plan"]
    assert same["ok"] and same["bitwise_equal"] and same["rel_err"] == 0.0
    assert same["rows"] == 2 and same["bucket"] == 4
    splits = same["splits"]
    # The replayed step and the eager one compared with it ran one plan; the
    # unpadded eager step of the same rows plans fewer splits (2 sequences, not 4).
    assert splits["graph_replay"] == splits["same_bucket_eager"] == [2]
    assert splits["unpadded_eager"] == [1]


def test_latency_figures_have_the_shape_of_vllm_bench_latency(smoke):
    _, report, _ = smoke
    latency = report["latency"]
    assert latency["shape"]["input_len"] == 12 and latency["shape"]["output_len"] == 3
    rows = {row["batch"]: row for row in latency["runs"]}
    assert set(rows) == {1, 4}
    for batch, row in rows.items():
        assert row["iterations"] == 1
        assert row["e2e_s"]["n"] == 1
        assert row["ttft_ms"]["n"] == row["tpot_ms"]["n"] == batch  # one per row
        assert set(row["tpot_ms"]) == {"n", "mean", "median", "p99"}
        # the batch's end-to-end latency is its last row's: after every first token
        assert row["e2e_s"]["mean"] * 1e3 >= row["ttft_ms"]["p99"]


def test_decode_rows_count_bytes_each_row_reads(smoke):
    _, report, _ = smoke
    rows = {row["batch"]: row for row in report["model"]["decode"]}
    one, four = rows[1], rows[4]
    per_position = 2 * 2 * 2 * 16 * 2  # layers x (K, V) x KV heads x head_dim x fp16
    # 64 cached, then per batch size and mode 1 warm-up and 2 timed steps: at
    # batch 1 row 0 reads 66 and 67 positions; at batch 4 row 0 has run 6 steps
    # more than rows 1-3 (72 + 3 x 66, then 73 + 3 x 67), not 4 x row 0's.
    assert one["eager_kv_read_gb"] == pytest.approx(66.5 * per_position / 1e9)
    assert four["eager_kv_read_gb"] == pytest.approx(272 * per_position / 1e9)
    weights = one["eager_read_gb"] - one["eager_kv_read_gb"]
    assert four["eager_read_gb"] - four["eager_kv_read_gb"] == pytest.approx(
        weights + 3 * 64 * 2 / 1e9
    )  # three more embedding rows of 64 fp16 values, not the table


def test_budget_spent_skips_sections_without_failing(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run(command("--json", str(out), "--budget-s", "0"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["status"] == "complete" and report["failures"] == []
    assert report["device"]["copy_ceiling_gbps"] > 0  # the device section always runs
    for section in ("kernels", "model", "latency", "attention", "host"):
        assert report["skipped"][section].startswith("budget"), section
        assert section not in report
    assert "skipped" in proc.stdout


def test_a_killed_run_leaves_every_figure_it_had(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.Popen(command("--json", str(out)), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    report = None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists():
                report = json.loads(out.read_text())  # always a whole document
                if report["section"] == "kernels" and len(report.get("kernels", {})) >= 2:
                    break
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    assert report is not None and report["section"] == "kernels"
    report = json.loads(out.read_text())
    assert report["status"] == "running"
    assert report["device"]["copy_ceiling_gbps"] > 0
    assert len(report["kernels"]) >= 2 and all(v["ok"] for v in report["kernels"].values())


def test_compile_section_reports_variants_and_spills(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    monkeypatch.setattr(sys, "path", sys.path)
    import gpu_check
    from gpu_check_support import Budget, Report

    fake = tmp_path / "compile_variants.py"
    fake.write_text(textwrap.dedent(
        """
        import json
        import iterserve.kernels  # the checkout is mapped for it
        for regs, spills in ((96, False), (255, True)):
            print(json.dumps({"kernel": "_k", "constexprs": {"B": regs}, "num_warps": 4,
                              "registers": regs, "spill_stores": 8 * spills, "spills": spills}))
        print(json.dumps({"variants": 2, "spilling": 1}))
        raise SystemExit(1)
        """
    ))  # fmt: skip
    report = Report(False, tmp_path / "out.json")
    gpu_check.check_compile(report, Budget(60, time.perf_counter()), script=fake)
    data = json.loads((tmp_path / "out.json").read_text())["compile"]
    assert data["every_variant_compiles"]["ok"] and data["every_variant_compiles"]["variants"] == 2
    assert data["max_registers"] == {"_k": 255}
    assert [v["registers"] for v in data["spilling_variants"]] == [255]

    fake.write_text("raise SystemExit('broken')\n")
    gpu_check.check_compile(report, Budget(60, time.perf_counter()), script=fake)
    assert report.data["failures"] == ["compile.every_variant_compiles"]
