"""The per-step token budget: configured, or derived from the ranks' device."""

from __future__ import annotations

import pytest

from iterserve.scheduler import Scheduler, SchedulerConfig
from iterserve.scheduler.config import CONTEXT_CAP, CPU_STEP_TOKENS, CUDA_STEP_TOKENS


def resolved(device: str, **kw) -> SchedulerConfig:
    return SchedulerConfig(**kw).resolved(num_kv_blocks=4096, max_model_len=2048, device=device)


@pytest.mark.parametrize(
    "device, budget",
    [("cpu", CPU_STEP_TOKENS), ("cuda", CUDA_STEP_TOKENS), ("cuda:1", CUDA_STEP_TOKENS)],
)
def test_an_unset_budget_is_the_devices_default(device, budget):
    assert resolved(device).max_num_batched_tokens == budget
    assert Scheduler(resolved(device)).stats()["max_num_batched_tokens"] == budget


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
