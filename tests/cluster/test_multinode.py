"""Two Ray nodes (ray.cluster_utils.Cluster): ranks are placed on both and serve."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from iterserve.scheduler import FakeExecutor, SamplingParams

SCRIPT = pathlib.Path(__file__).with_name("multinode_main.py")


def test_workers_spread_over_two_nodes_serve_correctly():
    # Its own process: a second Ray cluster cannot share this session's driver.
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300,
        cwd=SCRIPT.parents[2],
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["num_nodes"] == 2
    assert len(set(result["worker_nodes"])) == 2, "both ranks on one node"
    reference = FakeExecutor(output_len=5)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for request_id, tokens in result["outputs"].items():
        assert tokens == reference.expected_output(request_id, params)[0]
