"""The prefix-caching benchmark on a tiny random checkpoint, seconds-long workloads.

No timing asserts: only that both modes did the same work, the cache did its
part of it, and the figures are well formed. The speed figures come from
``iterserve bench prefix``.
"""

from __future__ import annotations

import json

import pytest

from iterserve.bench import prefix, workloads
from tests.workers.tiny_checkpoints import build_hf_model, save

KEYS = ("throughput_tok_s", "total_throughput_tok_s", "ttft_p50_s", "ttft_p99_s",
        "prefix_cache_hit_rate", "num_prefill_tokens", "num_output_tokens", "makespan_s")  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(save(build_hf_model("llama"), tmp_path_factory.mktemp("bench") / "tiny"))


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn"])
def test_both_modes_compute_the_same_tokens_and_the_cache_saves_prefill(
    ray_session, tiny_model, workload
):
    result = prefix.compare(workload, tiny_model, scale="small", log=lambda *_: None)
    on, off = result["modes"]["cache_on"], result["modes"]["cache_off"]
    for name, entry in result["modes"].items():
        missing = [k for k in KEYS if entry.get(k) is None]
        assert not missing, (name, missing)
        assert entry["num_errors"] == 0
    assert on["num_output_tokens"] == off["num_output_tokens"]
    assert off["prefix_cache_hit_rate"] == 0.0 < on["prefix_cache_hit_rate"]
    assert on["num_prefill_tokens"] < off["num_prefill_tokens"]
    assert set(result["ratios"]) >= {"ttft_p50_on_over_off", "throughput_on_over_off"}
    assert [t["name"] for t in result["targets"]] == (
        ["TTFT p50, cache on / off", "throughput, cache on / off"]
        if workload == "shared-prefix" else []
    )  # fmt: skip
    assert "hit rate" in prefix.render(result)
    json.dumps(result)  # the result is plain JSON


@pytest.mark.slow
def test_prefix_aware_routing_keeps_each_chat_on_the_replica_holding_its_history(
    ray_session, tiny_model
):
    """Two replicas, the same tokens either way; routed by prefix, every later turn
    finds its history cached (the slack is never reached at this load), so the
    hit rate is at least load-only routing's."""
    result = prefix.compare("multi-turn", tiny_model, scale="small", routing=True,
                            log=lambda *_: None)  # fmt: skip
    by_load, by_prefix = result["modes"]["routing_load"], result["modes"]["routing_prefix"]
    assert result["workload"]["engine_replicas"] == 2
    assert by_load["num_output_tokens"] == by_prefix["num_output_tokens"]
    assert by_prefix["prefix_cache_hit_rate"] >= by_load["prefix_cache_hit_rate"]
    assert by_prefix["prefix_cache_hit_rate"] > 0
    assert by_prefix["num_prefill_tokens"] <= by_load["num_prefill_tokens"]
    assert set(result["ratios"]) >= {"ttft_p50_prefix_over_load", "throughput_prefix_over_load"}
    assert result["targets"] == []


def test_shared_prefix_requests_start_with_one_of_a_few_system_prompts():
    spec = workloads.PREFIX_SPECS["shared-prefix"]["full"]
    requests = workloads.shared_prefix_requests(spec, 4096, seed=0)
    assert len(requests) == spec.num_requests
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    prefixes = {tuple(r.prompt_ids[: spec.prefix_len]) for r in requests}
    assert len(prefixes) == spec.num_prefixes
    lo, hi = spec.question_len
    assert all(lo <= len(r.prompt_ids) - spec.prefix_len <= hi for r in requests)
    assert all(len(r.prompt_ids) + r.output_len <= spec.max_model_len for r in requests)


def test_a_conversations_last_turn_fits_the_context():
    spec = workloads.PREFIX_SPECS["multi-turn"]["full"]
    chats = workloads.conversations(spec, 4096, seed=0)
    assert len(chats) == spec.num_conversations
    for chat in chats:
        assert len(chat.messages) == spec.num_turns
        history = sum(map(len, chat.messages)) + spec.num_turns * spec.output_len
        assert history <= spec.max_model_len
