"""The fairness scenario's figures: Jain's index, and the simulated scenario at a
small size (the real scheduler on the cost model's clock)."""

from __future__ import annotations

import pytest

from iterserve.bench.fairness import Scenario, jain, render, summarize
from iterserve.bench.fairness_sim import simulate_fairness

SMALL = Scenario(
    flood_requests=96, flood_prompt=3000, flood_output=64, light_tenants=2, light_requests=8,
    light_prompt=100, light_output=16, light_interval_s=0.2, pair_requests=160,
    pair_prompt=2000, pair_output=32, window_s=2.0,
)  # fmt: skip


def test_jains_index_is_one_for_an_even_share_and_one_over_n_for_one_alone():
    assert jain([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain([0.0, 0.0]) is None


def test_in_the_simulated_flood_fair_serves_the_light_tenants_in_a_few_steps():
    result = simulate_fairness(gpu="h200", model="8b", scenario=SMALL)
    priority, fair = result["policies"]["priority"], result["policies"]["fair"]
    assert fair["light_ttft_p90_flood_steps"] < 10 < priority["light_ttft_p90_flood_steps"]
    # The flood's own throughput stays what it was: only the order changed.
    assert fair["flood_tok_s_vs_priority"] > 0.9
    gold = result["fair_pairs"]["pair_2_1"]
    assert gold["windows"] >= 2 and 1.8 <= gold["ratio_min"] <= gold["ratio_max"] <= 2.2
    assert result["fair_pairs"]["pair_1_1"]["jain_min"] >= 0.95


def test_the_summary_sets_each_policy_against_priority_and_prints_every_percentile():
    def percentiles(p90):  # p50 half of p90, p99 twice it; E2E a second more
        return {f"{name}_p{q}_ms": p90 * {50: 0.5, 90: 1, 99: 2}[q] + (1000 if name == "e2e" else 0)
                for name in ("ttft", "e2e") for q in (50, 90, 99)}  # fmt: skip

    def entry(alone, flood, tok_s):
        return {"alone": {"light": percentiles(alone)},
                "flood": {"light": percentiles(flood), "flood": percentiles(5000),
                          "light_ttft_p90_steps": flood / 10, "flood_tok_s": tok_s,
                          "flood_finished_s": 1.0, "mean_step_ms": 10.0},
                "single": {"flood_tok_s": tok_s * 2}}  # fmt: skip

    summary = summarize({"priority": [entry(40, 4000, 100.0)], "fair": [entry(40, 120, 98.0)]})
    assert summary["fair"]["light_ttft_p90_ratio"] == 3.0
    assert summary["fair"]["flood_tok_s_vs_priority"] == 0.98
    assert summary["priority"]["light_ttft_p90_flood_steps"] == 400.0
    assert summary["fair"]["single_tenant_tok_s_vs_priority"] == 0.98
    assert summary["fair"]["light_e2e_p99_flood_ms"] == 1240
    assert summary["fair"]["flood_ttft_p50_flood_ms"] == 2500
    printed = render({"summary": summary}).splitlines()
    assert "light TTFT 60.0 / 120.0 / 240.0, E2E 1060.0 / 1120.0 / 1240.0" in printed[4]
    assert "flood TTFT 2500.0 / 5000.0 / 10000.0, E2E 3500.0 / 6000.0 / 11000.0" in printed[4]
