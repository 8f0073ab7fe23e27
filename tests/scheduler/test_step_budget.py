"""The per-step token budget: configured, or derived from the ranks' device."""

from __future__ import annotations

import pytest

from iterserve.scheduler import FakeExecutor, Request, SamplingParams, Scheduler, SchedulerConfig
from iterserve.scheduler.config import CONTEXT_CAP, CPU_STEP_TOKENS, CUDA_STEP_TOKENS
from tests.scheduler.driver import one_step, prompt_for


def resolved(device: str, **kw) -> SchedulerConfig:
    return SchedulerConfig(**kw).resolved(num_kv_blocks=4096, max_model_len=2048, device=device)


@pytest.mark.parametrize(
    "device, budget",
    [("cpu", CPU_STEP_TOKENS), ("cuda", CUDA_STEP_TOKENS), ("cuda:1", CUDA_STEP_TOKENS)],
)
def test_an_unset_budget_is_the_devices_default(device, budget):
    assert resolved(device).max_num_batched_tokens == budget
    assert Scheduler(resolved(device)).stats()["max_num_batched_tokens"] == budget


def test_an_unset_budget_takes_the_models_own_where_the_engine_gives_one():
    config = SchedulerConfig().resolved(num_kv_blocks=4096, max_model_len=2048, device="cpu",
                                        step_tokens=2048)  # fmt: skip
    assert config.max_num_batched_tokens == 2048
    configured = SchedulerConfig(max_num_batched_tokens=600).resolved(
        num_kv_blocks=4096, max_model_len=2048, device="cpu", step_tokens=2048
    )
    assert configured.max_num_batched_tokens == 600


def test_a_configured_budget_is_kept_on_every_device():
    for device in ("cpu", "cuda"):
        assert resolved(device, max_num_batched_tokens=1000).max_num_batched_tokens == 1000


def test_the_derived_budget_lets_every_slot_decode_in_one_step():
    assert resolved("cpu", max_num_seqs=700).max_num_batched_tokens == 700


@pytest.mark.parametrize("policy", ["static", "dynamic", "continuous"])
def test_whole_prompt_policies_derive_a_budget_that_holds_the_longest_prompt(policy):
    config = SchedulerConfig(policy=policy).resolved(
        num_kv_blocks=4096, max_model_len=4096, device="cpu"
    )
    assert config.max_num_batched_tokens == 4096
    # A configured context length is the one that counts.
    assert resolved("cuda", policy=policy, max_model_len=3000).max_num_batched_tokens == 3000


def test_chunked_prefill_derives_the_devices_budget_whatever_the_context():
    config = SchedulerConfig(policy="chunked").resolved(
        num_kv_blocks=4096, max_model_len=4096, device="cpu"
    )
    assert config.max_num_batched_tokens == CPU_STEP_TOKENS


def test_a_scheduler_refuses_a_config_whose_budget_was_never_derived():
    config = SchedulerConfig(max_model_len=64, num_kv_blocks=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(config)


def test_a_configured_budget_is_still_checked_against_slots_and_context():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be >= max_num_seqs"):
        SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="prefills whole prompts"):
        SchedulerConfig(policy="continuous", max_num_batched_tokens=512, max_model_len=1024)


def test_the_context_is_the_configured_one_or_the_checkpoints_up_to_the_cap():
    assert SchedulerConfig().context_for(2048) == 2048
    assert SchedulerConfig().context_for(131072) == CONTEXT_CAP
    assert SchedulerConfig(max_model_len=8192).context_for(131072) == 8192
    assert SchedulerConfig(max_model_len=8192).context_for(4096) == 4096


def test_a_whole_prompt_budget_follows_the_context_the_engine_picks_not_the_checkpoints():
    config = SchedulerConfig(policy="continuous")
    # What a rank sizes its workspace for, on a checkpoint of 128K positions.
    assert config.step_budget("cuda", config.context_for(131072)) == CONTEXT_CAP


def small_model_cpu(**kw) -> Scheduler:
    """A chunked scheduler as a CPU engine builds it for a small model: the model's
    2048-token budget, the device's 512 for decodes and short prompts."""
    base = SchedulerConfig(policy="chunked", max_num_seqs=128, enable_prefix_caching=False, **kw)
    config = base.resolved(num_kv_blocks=8192, max_model_len=2048, device="cpu", step_tokens=2048)
    short = base.short_budget("cpu", 2048, step_tokens=2048)
    return Scheduler(config, short_budget=short, ahead=False)


def plan_tokens(sched: Scheduler, requests) -> dict[str, int]:
    for request in requests:
        sched.add_request(request)
    plan, _ = one_step(sched, FakeExecutor(block_size=16))
    by_slot = {r.slot_idx: r.request_id for r in requests if r.slot_idx >= 0}
    return {by_slot[e.slot_idx]: e.num_tokens for e in plan.scheduled}


def prompt(request_id: str, n: int) -> Request:
    return Request(request_id, prompt_for(request_id, n), SamplingParams(max_tokens=4))


def test_only_a_small_models_cpu_engine_splits_its_budget():
    assert SchedulerConfig().short_budget("cpu", 2048, step_tokens=2048) == CPU_STEP_TOKENS
    assert SchedulerConfig().short_budget("cpu", 2048, step_tokens=512) is None
    assert SchedulerConfig().short_budget("cpu", 2048, step_tokens=None) is None
    configured = SchedulerConfig(max_num_batched_tokens=2048)
    assert configured.short_budget("cpu", 2048, step_tokens=2048) is None
    # tenants share every step under fair: the device's 512, one budget
    fair = SchedulerConfig(scheduling_policy="fair")
    assert fair.short_budget("cpu", 2048, step_tokens=2048) is None
    assert fair.step_budget("cpu", 2048, step_tokens=2048) == CPU_STEP_TOKENS


def test_a_burst_of_short_prompts_takes_the_devices_budget_a_step():
    sched = small_model_cpu()
    taken = plan_tokens(sched, [prompt(f"s{i}", 32) for i in range(64)])
    assert sum(taken.values()) == CPU_STEP_TOKENS and set(taken.values()) == {32}


def test_a_long_prompt_takes_the_models_budget_and_short_ones_what_512_leave():
    sched = small_model_cpu(max_num_partial_prefills=2)
    taken = plan_tokens(sched, [prompt("long", 1000), prompt("long2", 1500)]
                        + [prompt(f"s{i}", 40) for i in range(4)])  # fmt: skip
    # the long ones fill the model's 2048; the short ones get what is left of it
    assert taken["long"] == 1000 and taken["long2"] == 1048
    assert sum(taken.values()) == 2048
    sched = small_model_cpu()
    taken = plan_tokens(sched, [prompt("long", 1000)] + [prompt(f"s{i}", 200) for i in range(4)])
    # 1000 of the long one, then short ones up to 512 of their own
    assert taken["long"] == 1000 and sum(v for k, v in taken.items() if k != "long") == 512
