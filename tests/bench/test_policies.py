"""The policy comparison on a tiny random checkpoint and a seconds-long workload.

No timing asserts: only that every policy did the same work and the figures
are well formed. The speed figures come from ``iterserve bench policies``.
"""

from __future__ import annotations

import argparse
import json

import pytest

from iterserve.bench import policies, workloads
from iterserve.bench.report import prometheus_values, step_figures
from iterserve.cluster.metrics.engine import EngineMetrics
from tests.workers.tiny_checkpoints import build_hf_model, save

KEYS = ("throughput_tok_s", "slot_utilization", "padding_fraction", "ttft_p50_s", "ttft_p99_s",
        "itl_p99_s", "e2e_p50_s", "e2e_p99_s", "num_steps", "num_output_tokens")  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(save(build_hf_model("llama"), tmp_path_factory.mktemp("bench") / "tiny"))


@pytest.fixture(scope="module")
def longtail(ray_session, tiny_model) -> dict:
    return policies.compare("longtail", tiny_model, scale="small", log=lambda *_: None)


@pytest.mark.slow
def test_every_policy_and_the_baseline_report_every_figure(longtail):
    assert set(longtail["policies"]) == {"static", "dynamic", "continuous", "chunked"}
    entries = {**longtail["policies"], "hf_generate": longtail["hf_generate"]}
    for name, entry in entries.items():
        missing = [k for k in KEYS if entry.get(k) is None]
        assert not missing, (name, missing)
        assert 0.0 <= entry["slot_utilization"] <= 1.0, name
        assert 0.0 <= entry["padding_fraction"] <= 1.0, name
    assert {"seed", "num_output_tokens", "max_num_seqs", "model"} <= set(longtail["workload"])
    json.dumps(longtail)  # the result is plain JSON


@pytest.mark.slow
def test_every_policy_computes_exactly_the_workloads_output_tokens(longtail):
    expected = longtail["workload"]["num_output_tokens"]
    entries = {**longtail["policies"], "hf_generate": longtail["hf_generate"]}
    assert {name: e["num_output_tokens"] for name, e in entries.items()} == dict.fromkeys(
        entries, expected
    )


@pytest.mark.slow
def test_static_batching_pays_for_padding_and_continuous_pays_none(longtail):
    p = longtail["policies"]
    assert p["continuous"]["padding_fraction"] == 0.0 == p["chunked"]["padding_fraction"]
    assert p["static"]["padding_fraction"] > p["continuous"]["padding_fraction"]
    assert p["static"]["num_padding_tokens"] > 0
    assert longtail["hf_generate"]["padding_fraction"] > 0


@pytest.mark.slow
def test_targets_name_each_ratio_and_whether_it_was_met(longtail):
    names = {t["name"] for t in longtail["targets"]}
    assert "continuous / static throughput" in names
    assert all(isinstance(t["met"], bool) for t in longtail["targets"])


@pytest.mark.slow
def test_long_prompts_break_the_stream_and_long_prompt_figures_apart(ray_session, tiny_model):
    result = policies.compare(
        "long-prompts", tiny_model, policies=("continuous", "chunked"), hf=False,
        scale="small", log=lambda *_: None,
    )  # fmt: skip
    for entry in result["policies"].values():
        assert entry["num_output_tokens"] == result["workload"]["num_output_tokens"]
        assert entry["stream_itl_p99_s"] is not None and entry["long_ttft_p99_s"] is not None
    assert {t["name"] for t in result["targets"]} == {
        "continuous / chunked stream ITL p99",
        "chunked / continuous throughput",
    }


def test_long_prompts_workload_keeps_streams_running_while_long_prompts_arrive():
    spec = workloads.SPECS["long-prompts"]["full"]
    requests = workloads.build(spec, vocab_size=4096, seed=0)
    streams = [r for r in requests if r.kind == "stream"]
    long = [r for r in requests if r.kind == "long"]
    assert len(streams) == spec.num_streams and len(long) == spec.num_requests - spec.num_streams
    assert all(len(r.prompt_ids) >= spec.max_model_len // 2 for r in long)
    assert all(len(r.prompt_ids) + r.output_len <= spec.max_model_len for r in requests)
    assert all(r.output_len > 10 * long[0].output_len for r in streams)
    assert workloads.build(spec, 4096, 0)[5].prompt_ids == requests[5].prompt_ids  # seeded


def test_slot_utilization_counts_live_sequences_per_slot_and_step():
    metrics = EngineMetrics("m", 0, "static")
    before = prometheus_values(metrics.exposition())
    for running, padding in ((4, 0), (2, 2), (1, 3)):  # a batch of 4 whose members finish
        metrics.observe_step(duration_s=0.01, forward_s=0.01, built_ahead=False,
                             num_prefill_tokens=0, num_decode_tokens=running,
                             num_padding_tokens=padding, num_running=running, max_num_seqs=4)  # fmt: skip
    figures = step_figures(before, prometheus_values(metrics.exposition()), max_num_seqs=4)
    assert figures["num_steps"] == 3
    assert figures["slot_utilization"] == pytest.approx(7 / 12, abs=1e-4)
    assert figures["padding_fraction"] == pytest.approx(5 / 12, abs=1e-4)


def test_the_subcommand_parses_into_its_function():
    parser = argparse.ArgumentParser()
    policies.register(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["policies", "--workload", "long-prompts", "--json", "x.json"])
    assert args.func is policies.main and args.workload == "long-prompts"
    assert args.json == "x.json" and args.png is None
