"""``max_tokens: 0``: a request computes its prompt and finishes with reason length,
sampling nothing, under every policy, scheduled ahead or not, through the codec."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.scheduler import POLICIES, FakeExecutor, SamplingParams, Scheduler
from tests.scheduler.driver import run
from tests.scheduler.test_properties import workloads


@st.composite
def mixed_workloads(draw, policy: str):
    config, arrivals, kv_window = draw(workloads(policy))
    prompt_only = draw(st.sets(st.integers(0, len(arrivals) - 1), min_size=1))
    keys = {arrivals[i].key for i in prompt_only}
    # A reused request id shares its fake output; keep every user of it alike.
    ids = {arrivals[i].request_id for i in prompt_only}
    arrivals = [
        dataclasses.replace(a, max_tokens=0) if a.request_id in ids or a.key in keys else a
        for a in arrivals
    ]
    return config, arrivals, kv_window


def wrong_outputs(config, arrivals, kv_window, *, ahead: bool) -> list:
    """The requests whose output or finish reason breaks the rules (a prompt-only
    one samples nothing and ends with length; the others as the fake model says),
    and what the scheduler still holds after the run."""
    targets = {a.request_id: a.output_len for a in arrivals}
    window = kv_window if config.kv_layout == "paged" else None
    executor = FakeExecutor(
        vocab_size=128, output_len=targets.__getitem__, block_size=config.block_size,
        kv_window=window,
    )  # fmt: skip
    sched = Scheduler(config, kv_window=kv_window)
    log = run(sched, executor, arrivals, through_codec=True, ahead=ahead)
    wrong = []
    for a in arrivals:
        reason = log.reasons.get(a.key)
        if reason == "abort":
            continue
        if a.max_tokens == 0:
            expected, why = [], "length"
        else:
            max_tokens = min(a.max_tokens, config.max_model_len - a.prompt_len)
            expected, why = executor.expected_output(
                a.request_id, SamplingParams(max_tokens=max_tokens, temperature=0.0)
            )
        if log.outputs[a.key] != expected or reason != why:
            wrong.append((a.key, log.outputs[a.key], reason))
    if sched.blocks.num_used or sched.slots.num_used or sched.requests:
        wrong.append(("held after the run", sched.blocks.num_used, sched.slots.num_used))
    return wrong


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("ahead", [False, True], ids=["one-at-a-time", "ahead"])
def test_prompt_only_requests_finish_after_their_prefill(policy, ahead):
    @SETTINGS
    @given(mixed_workloads(policy))
    def prop(workload):
        assert wrong_outputs(*workload, ahead=ahead) == []

    prop()


def test_prompt_logprobs_come_once_with_the_step_completing_the_prompt():
    from iterserve.scheduler import Request, SchedulerConfig

    config = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=4, max_model_len=32, block_size=4, num_kv_blocks=16
    )
    sched = Scheduler(config)
    executor = FakeExecutor(vocab_size=64, output_len=3, block_size=4)
    params = SamplingParams(max_tokens=3, prompt_logprobs=1, logprobs=0)
    sched.add_request(Request("r", [5, 6, 7, 8, 9, 10], params))
    outputs = []
    while sched.has_work:
        step = sched.schedule(0.0)
        outputs += sched.update(executor.execute(step.plan)).outputs
    prompts = [out.prompt_logprobs for out in outputs if out.prompt_logprobs is not None]
    (prompt,) = prompts  # a prompt of 6, in pieces of 4: once, with its first token
    assert outputs[0].prompt_logprobs is prompt and outputs[0].new_token_ids
    assert prompt.token_logprobs == [-0.5] * 5
    assert prompt.top_logprobs == [[(t, -0.5)] for t in [6, 7, 8, 9, 10]]
    assert sum(len(out.new_logprobs) for out in outputs) == 3  # one per token
