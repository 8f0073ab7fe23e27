"""Two Ray nodes (ray.cluster_utils.Cluster): the demo model's two tensor-parallel
ranks run one on each node and generate what one process generates."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from iterserve.models import DEMO_MODEL_PATH
from iterserve.scheduler import SamplingParams
from tests.cluster.conftest import single_process

SCRIPT = pathlib.Path(__file__).with_name("multinode_main.py")
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
MAX_TOKENS = 8


def test_ranks_on_two_nodes_generate_what_one_process_generates():
    # Its own process: a second Ray cluster cannot share this session's driver.
    request = json.dumps({"prompts": PROMPTS, "max_tokens": MAX_TOKENS})
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), request],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=SCRIPT.parents[2],
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["num_nodes"] == 2
    assert len(set(result["worker_nodes"])) == 2, "both ranks on one node"
    assert "tcp" in result["rank_links"]  # over TCP to the other node's rank
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert result["outputs"] == single_process(str(DEMO_MODEL_PATH), PROMPTS, params)
