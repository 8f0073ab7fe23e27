"""The structured-outputs cost figure on the demo model with a tiny batch: both
batches compute the same tokens and the figures are well formed. No timing asserts;
the figure itself comes from ``iterserve bench structured``."""

from __future__ import annotations

import json

from iterserve.bench.structured_bench import structured_cost
from iterserve.cli import main


def test_the_cost_figure_compares_the_same_work(tmp_path):
    result = structured_cost(num_seqs=4, max_tokens=6, rounds=2)
    assert result["tokens"] == {"unconstrained": 24, "half_constrained": 24}
    assert result["num_constrained"] == 2
    assert all(len(v) == 2 and min(v) > 0 for v in result["tok_s"].values())
    runs = result["tok_s"]
    ratios = sorted(a / b for a, b in zip(runs["half_constrained"], runs["unconstrained"]))
    assert ratios[0] - 1e-3 <= result["ratio"] <= ratios[-1] + 1e-3  # a median of the rounds
    assert result["cpu_ratio"] > 0 and set(result["median_cpu_tok_s"]) == set(runs)
    out = tmp_path / "structured.json"
    args = ["bench", "structured", "--num-seqs", "2", "--max-tokens", "3", "--rounds", "1"]
    assert main([*args, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["tokens"]["half_constrained"] == 6
