"""``iterserve bench lora`` runs end to end at a toy size and reports its ratios."""

from __future__ import annotations

from iterserve.bench.lora import bench_lora_step


def test_the_step_bench_reports_each_way_against_the_base_step():
    out = bench_lora_step(rows=8, num_adapters=2, rank=4, context=16, steps=2)
    for mode in ("kernel", "batched", "segments", "gather"):
        assert out[f"{mode}_tok_s"] > 0 and out[f"{mode}_vs_base"] > 0
    assert out["adapters"] == 2 and out["rows"] == 8


def test_the_serving_bench_runs_requests_over_adapters_through_the_engine(ray_session):
    from iterserve.bench.lora import bench_lora_serving

    out = bench_lora_serving(num_requests=4, num_adapters=2, max_loras=1, rank=4,
                             max_tokens=4, rounds=1)  # fmt: skip
    assert out["base_tok_s"] > 0 and out["lora_tok_s"] > 0 and out["lora_vs_base"] > 0
