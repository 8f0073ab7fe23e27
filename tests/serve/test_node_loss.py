"""A node lost: its engine replica's requests go to the replica left (none
fails), and Serve's replacement serves once a node joins (two Ray nodes on this
machine, one CPU each; see node_loss_main.py)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).with_name("node_loss_main.py")


def test_a_lost_nodes_replica_costs_no_request_and_is_replaced_on_a_new_node():
    # Its own process: a second Ray cluster cannot share this session's driver.
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900,
        cwd=SCRIPT.parents[2],
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["nodes_before"] == 2, result  # one replica on each node
    for load in ("before", "after_loss", "after_new_node"):
        assert set(result[load]) == {200}, (load, result[load])
    assert result["serving_after_loss"] == 1
    assert result["serving_after_new_node"] == 2
