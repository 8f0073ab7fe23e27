"""``iterserve bench lora`` runs end to end at a toy size and reports its ratios."""

from __future__ import annotations

from iterserve.bench.lora import bench_lora_step


def test_the_step_bench_reports_each_way_against_the_base_step():
    out = bench_lora_step(rows=8, num_adapters=2, rank=4, context=16, steps=2)
    for mode in ("batched", "segments", "gather"):
        assert out[f"{mode}_tok_s"] > 0 and out[f"{mode}_vs_base"] > 0
    assert out["adapters"] == 2 and out["rows"] == 8
