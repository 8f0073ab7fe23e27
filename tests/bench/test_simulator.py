"""The roofline cost model and the simulator that drives the real scheduler with it."""

import json
import math

import pytest

from iterserve.bench.costmodel import MODELS, CostModel
from iterserve.bench.simulator import (
    LONG_PROMPT,
    MAX_TOKENS,
    run,
    simulate,
    simulate_policy,
    workload,
)
from iterserve.scheduler import POLICIES

# -- the cost model ------------------------------------------------------------------


def decode(cost, batch, context=512):
    return cost.step([(context, 1)] * batch, batch)


def test_model_sizes_match_llama3():
    assert MODELS["8b"].params == pytest.approx(8.03e9, rel=0.01)
    assert MODELS["70b"].params == pytest.approx(70.6e9, rel=0.01)
    # 32 layers x 8 KV heads x 128 x (K, V) x bf16 = 128 KiB per token.
    assert MODELS["8b"].kv_bytes_per_token == 128 * 1024


def test_decode_is_memory_bound_and_grows_sublinearly():
    cost = CostModel("h200", "8b")
    times = [decode(cost, b).time_s for b in (1, 2, 8, 32, 128)]
    assert times == sorted(times) and len(set(times)) == len(times)
    # The weights are read once whatever the batch: 128x the rows, far less than 128x the time.
    assert times[-1] < 3 * times[0]
    assert not decode(cost, 128).compute_bound
    # Two steps of b rows cost more than one step of 2b rows.
    assert decode(cost, 64).time_s < 2 * decode(cost, 32).time_s


def test_large_prefill_is_compute_bound_and_linear():
    cost = CostModel("h100", "8b")
    small, big, bigger = (cost.step([(0, n)], 1) for n in (16, 4096, 8192))
    assert not small.compute_bound
    assert big.compute_bound and bigger.compute_bound
    assert 1.8 < bigger.time_s / big.time_s < 2.3


def test_tensor_parallel_is_faster_for_70b():
    tp1, tp8 = CostModel("h200", "70b", tp=1), CostModel("h200", "70b", tp=8)
    assert tp8.tp == 8 and CostModel("h200", "70b").tp == 8
    assert decode(tp8, 64).time_s < decode(tp1, 64).time_s / 3
    assert tp8.step([(0, 2048)], 1).time_s < tp1.step([(0, 2048)], 1).time_s / 3


def test_padding_tokens_cost_time():
    cost = CostModel("h200", "8b")
    real = [(0, 100)] * 8
    padded = [(0, 1000)] * 8  # the same prompts padded to the longest, 1000
    assert cost.step(padded, 8).time_s > 2 * cost.step(real, 8).time_s
    # Finished members computed as padding rows while the batch decodes.
    assert decode(cost, 16).time_s > decode(cost, 8).time_s


def test_kv_capacity():
    cost = CostModel("h200", "8b")
    free = 141e9 * 0.9 - MODELS["8b"].weight_bytes
    assert cost.num_kv_blocks(16) == int(free // (128 * 1024 * 16))
    assert CostModel("h100", "70b").num_kv_blocks() > 0  # 8 x H100
    with pytest.raises(ValueError, match="does not fit"):
        CostModel("h100", "70b", tp=1).num_kv_blocks()
    with pytest.raises(ValueError, match="KV heads"):
        CostModel("h100", "70b", tp=3)


# -- the workload ----------------------------------------------------------------------


def test_workload_long_tail_mix():
    load = workload(2000, request_rate=10.0, seed=3)
    arrivals, prompts, outputs = load["arrival_s"], load["prompt_len"], load["output_len"]
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] / len(arrivals) == pytest.approx(0.1, rel=0.1)
    long = sum(p >= LONG_PROMPT[0] for p in prompts) / len(prompts)
    assert 0.15 < long < 0.25
    assert min(outputs) >= 1 and max(outputs) <= MAX_TOKENS
    assert sorted(outputs)[len(outputs) // 2] < sum(outputs) / len(outputs)  # right-skewed
    assert workload(10, math.inf)["arrival_s"] == [0.0] * 10


# -- the simulator -----------------------------------------------------------------------

SMALL = dict(gpu="h200", model="8b", num_requests=64, request_rate=20.0, max_num_seqs=32)


@pytest.fixture(scope="module")
def small():
    return simulate(**SMALL)


def test_every_policy_finishes_every_request(small):
    expected = sum(workload(64, 20.0, 0)["output_len"])
    assert set(small["policies"]) == set(POLICIES)
    for metrics in small["policies"].values():
        assert metrics["output_tokens"] == expected
        assert metrics["num_steps"] > 0 and metrics["throughput_tok_s"] > 0
        assert metrics["ttft_p50_s"] <= metrics["ttft_p99_s"] <= metrics["e2e_p99_s"]
        assert 0 < metrics["slot_utilization"] <= 1


def test_continuous_beats_static_on_the_long_tail(small):
    static, cont = small["policies"]["static"], small["policies"]["continuous"]
    assert cont["slot_utilization"] > 1.5 * static["slot_utilization"]
    assert cont["padding_fraction"] == 0 < static["padding_fraction"]
    assert cont["throughput_tok_s"] > static["throughput_tok_s"]


def test_chunked_cuts_tail_itl_when_long_prompts_arrive_mid_decode():
    # Eight chats decode 400 tokens; 4k-token prompts keep arriving meanwhile.
    load = {
        "arrival_s": [0.0] * 8 + [0.1 * (i + 1) for i in range(10)],
        "prompt_len": [100] * 8 + [4000] * 10,
        "output_len": [400] * 8 + [4] * 10,
    }
    cost = CostModel("h200", "8b")
    cont = simulate_policy("continuous", cost, load, max_num_seqs=32)
    chunked = simulate_policy("chunked", cost, load, max_num_seqs=32)
    assert chunked["itl_p99_s"] < 0.7 * cont["itl_p99_s"]
    assert chunked["throughput_tok_s"] > 0.9 * cont["throughput_tok_s"]


def test_same_seed_same_result():
    args = dict(SMALL, num_requests=24, policies=("dynamic", "chunked"))
    assert simulate(**args, seed=5) == simulate(**args, seed=5)
    assert simulate(**args, seed=5) != simulate(**args, seed=6)


def test_run_writes_json(tmp_path):
    path = tmp_path / "out" / "sim.json"
    result = run("h100", "70b", json_path=path, num_requests=16, policies=("continuous",))
    assert json.loads(path.read_text()) == result
    assert (result["gpu"], result["model"], result["tp"]) == ("h100", "70b", 8)
    assert set(result["policies"]) == {"continuous"}


# -- prefix caching ------------------------------------------------------------------------


def test_the_long_tail_mix_shares_no_prefix():
    result = simulate(**SMALL, policies=("chunked",))
    assert result["policies"]["chunked"]["prefix_cache_hit_rate"] == 0.0


def test_shared_system_prompts_are_prefilled_once_and_the_cache_pays_for_itself():
    from iterserve.bench.prefix_sim import prefix_workload, simulate_prefix

    load = prefix_workload(200, 20.0, seed=1, num_prefixes=4, prefix_len=1000)
    assert set(load["prefix_id"]) == {0, 1, 2, 3}
    assert all(p >= 1000 for p in load["prompt_len"])
    result = simulate_prefix(num_requests=200, request_rate=20.0, num_prefixes=4,
                             prefix_len=1000, max_num_seqs=64)  # fmt: skip
    on, off = result["modes"]["cache_on"], result["modes"]["cache_off"]
    assert on["output_tokens"] == off["output_tokens"]
    assert off["prefix_cache_hit_rate"] == 0.0 and on["prefix_cache_hit_rate"] > 0.8
    assert on["prefill_tokens"] < 0.25 * off["prefill_tokens"]
    assert result["ratios"]["ttft_p50_on_over_off"] < 1 < result["ratios"]["throughput_on_over_off"]


def test_run_simulates_the_shared_prefix_workload(tmp_path):
    path = tmp_path / "prefix.json"
    result = run("h200", "8b", json_path=path, workload="shared-prefix", num_requests=16)
    assert json.loads(path.read_text()) == result
    assert set(result["modes"]) == {"cache_off", "cache_on"}


def test_speculation_is_modelled_and_off_past_the_batch_limit():
    """Proposals accepted with probability 0.8 on an 8B model at one request: decode
    is weight-bound, so a step verifying 1 + 4 rows costs about one row's time and
    each emits ~3 tokens; past disable_by_batch_size no proposal is made."""
    from iterserve.bench.simulator import simulate_speculation

    result = simulate_speculation(
        acceptance=0.8, concurrency=(1, 16), output_len=256, disable_by_batch_size=8
    )
    one, sixteen = result["rows"]
    assert one["ratio"] > 2.0 and one["tokens_per_draft"] > 2.5
    assert sixteen["ratio"] == 1.0
