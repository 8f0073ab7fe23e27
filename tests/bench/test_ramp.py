"""``iterserve bench ramp`` (small): a load ramp with engine autoscaling on, run
as a user runs it (a subprocess, Ray of its own). The replicas scale out under
the load and back to the minimum after it, and no request fails. The JSON holds
the timeline and the summary; the PNG is written."""

from __future__ import annotations

import json
import subprocess

from tests.conftest import USER_ENV
from tests.test_quickstart import BIN


def test_a_load_ramp_scales_out_and_back_with_no_failed_request(tmp_path):
    out, png = tmp_path / "ramp.json", tmp_path / "ramp.png"
    done = subprocess.run(
        [str(BIN / "iterserve"), "bench", "ramp", "--scale", "small",
         "--json", str(out), "--png", str(png)],
        cwd=tmp_path, env=USER_ENV, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["failed_requests"] == 0, summary["errors"]
    assert summary["requests"] > 0
    assert summary["max_replicas_reached"] > summary["min_replicas"], summary
    assert summary["final_replicas"] == summary["min_replicas"], summary
    phases = {s["phase"] for s in result["samples"]}
    assert {"idle", "ramp", "hold", "steady", "cooldown"} <= phases
    assert png.stat().st_size > 10_000
