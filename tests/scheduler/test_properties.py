"""Property tests: random workloads under every policy, invariants checked after every step."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.scheduler import POLICIES, FakeExecutor, SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.driver import Arrival, arrival_prompt, prompt_for, run

VOCAB = 128


def max_tokens_of(a: Arrival, config: SchedulerConfig) -> int:
    return min(a.max_tokens, config.max_model_len - a.prompt_len)


@st.composite
def workloads(draw, policy: str, speculative: bool = False):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_num_seqs = draw(st.integers(1, 8))
    max_model_len = draw(st.integers(4, 48))
    if policy == "chunked":
        budget = draw(st.integers(max_num_seqs, max_num_seqs + 40))
    else:
        budget = draw(st.integers(max(max_model_len, max_num_seqs), 2 * max_model_len + 8))
    per_seq = -(-max_model_len // block_size)
    num_blocks = draw(st.integers(per_seq, per_seq * (max_num_seqs + 1)))
    config = SchedulerConfig(
        policy=policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        kv_layout="paged" if speculative else draw(st.sampled_from(["paged", "paged", "slab"])),
        max_num_partial_prefills=draw(st.integers(1, 3)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 8])),
        batch_timeout_s=float(draw(st.integers(0, 4))),
        batch_wait_s=float(draw(st.integers(0, 2))),
        enable_prefix_caching=draw(st.booleans()) or draw(st.booleans()),
        speculative_config=draw(speculative_configs()) if speculative else {},
    )
    # A model whose every layer slides over a window (blocks before it are handed
    # on while a sequence runs), or one with a full-attention layer.
    kv_window = draw(st.one_of(st.none(), st.none(), st.integers(1, max_model_len)))
    n = draw(st.integers(1, 14))
    # A few system prompts that some requests start with (whole prompts repeat too).
    prefixes = draw(st.lists(st.integers(1, max_model_len - 1), min_size=1, max_size=3))
    arrivals = []
    for i in range(n):
        prompt_len = draw(st.integers(1, max_model_len - 1))
        shared = draw(st.integers(-1, len(prefixes) - 1))
        abort = draw(st.booleans()) and draw(st.booleans())
        arrival = Arrival(
            request_id=f"r{i}",
            step=draw(st.integers(0, 30)),
            prompt_len=prompt_len,
            max_tokens=draw(st.integers(1, 24)),
            output_len=draw(st.one_of(st.none(), st.integers(1, 24))),
            priority=draw(st.integers(0, 2)),
            abort_step=draw(st.integers(0, 60)) if abort else None,
            abort_in_flight=draw(st.booleans()),
            prefix=f"p{shared}" if shared >= 0 else "",
            prefix_len=prefixes[shared] if shared >= 0 else 0,
        )
        if arrivals and draw(st.integers(0, 4)) == 0:
            # A client reuses an earlier request's id, often right after aborting it
            # while a step for it is still in flight.
            earlier = draw(st.sampled_from(arrivals))
            arrival.key, arrival.request_id = arrival.request_id, earlier.request_id
            arrival.output_len = earlier.output_len  # the fake's output is per request_id
            if earlier.abort_step is not None and draw(st.booleans()):
                arrival.step = earlier.abort_step
        elif arrivals and draw(st.integers(0, 3)) == 0:
            # A chat's next turn: an earlier prompt, its answer, and a new question.
            earlier = draw(st.sampled_from(arrivals))
            answer, _ = FakeExecutor(
                vocab_size=VOCAB, output_len=earlier.output_len
            ).expected_output(
                earlier.request_id, SamplingParams(max_tokens=max_tokens_of(earlier, config))
            )
            history = arrival_prompt(earlier) + answer + prompt_for(arrival.key, prompt_len)
            arrival.prompt = history[: max_model_len - 1]
            arrival.prompt_len = len(arrival.prompt)
            arrival.step = earlier.step + draw(st.integers(0, 30))
        arrivals.append(arrival)
    return config, arrivals, kv_window


def speculative_configs():
    """Proposals of 1-5 tokens on up to 1-8 decoding sequences, by prompt lookup or
    by the fake ranks' stand-in draft model (right about two times in three)."""
    draft = st.fixed_dictionaries({
        "method": st.just("draft_model"),
        "model": st.just("stand-in"),
        "num_speculative_tokens": st.integers(1, 5),
        "disable_by_batch_size": st.integers(1, 8),
    })  # fmt: skip
    return draft | st.fixed_dictionaries({
        "method": st.just("ngram"),
        "num_speculative_tokens": st.integers(1, 5),
        "prompt_lookup_min": st.integers(1, 2),
        "prompt_lookup_max": st.integers(2, 4),
        "disable_by_batch_size": st.integers(1, 8),
    })  # fmt: skip


def check_workload(
    config: SchedulerConfig,
    arrivals: list[Arrival],
    kv_window: int | None = None,
    through_codec=False,
    ahead=False,
    period: int | None = None,
) -> None:
    targets = {a.request_id: a.output_len for a in arrivals}  # equal for a reused id
    window = kv_window if config.kv_layout == "paged" else None  # a slab hands nothing on
    executor = FakeExecutor(
        vocab_size=VOCAB,
        output_len=targets.__getitem__,
        block_size=config.block_size,
        check_kv=True,
        kv_window=window,
        period=period,
    )
    sched = Scheduler(config, kv_window=kv_window)
    log = run(sched, executor, arrivals, through_codec=through_codec, ahead=ahead)
    for a in arrivals:
        max_tokens = max_tokens_of(a, config)
        expected, reason = executor.expected_output(
            a.request_id, SamplingParams(max_tokens=max_tokens, temperature=0.0)
        )
        got = log.outputs[a.key]
        if log.reasons.get(a.key) == "abort":
            assert got == expected[: len(got)], f"{a.key}: aborted output is not a prefix"
        else:
            # Exactly its expected tokens, despite preemptions and recompute.
            assert got == expected, f"{a.key}: {got} != {expected}"
            assert log.reasons[a.key] == reason
    # Everything is free at the end: aborts and finishes leak nothing.
    assert sched.blocks.num_used == 0
    assert sched.slots.num_used == 0
    assert not sched.requests


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(workloads("static"))
def test_static_invariants(workload):
    check_workload(*workload)


@SETTINGS
@given(workloads("dynamic"))
def test_dynamic_invariants(workload):
    check_workload(*workload)


@SETTINGS
@given(workloads("continuous"))
def test_continuous_invariants(workload):
    check_workload(*workload)


@SETTINGS
@given(workloads("chunked"))
def test_chunked_invariants(workload):
    check_workload(*workload)


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(POLICIES).flatmap(workloads))
def test_every_policy_through_the_codec(workload):
    """The same runs give the same outputs when every message crosses msgpack."""
    check_workload(*workload, through_codec=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(POLICIES).flatmap(workloads))
def test_scheduling_ahead_keeps_every_invariant_and_output(workload):
    """Each plan built while the step before it runs: the same tokens and finish
    reasons as one step at a time, despite EOS the scheduler learns a step late,
    preemptions, aborts in flight; nothing leaks."""
    check_workload(*workload, ahead=True)


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(POLICIES).flatmap(workloads))
def test_scheduling_ahead_through_the_codec(workload):
    check_workload(*workload, through_codec=True, ahead=True)


# Speculative decoding: outputs that repeat with a short period, so that prompt lookup
# proposes right often (accepted runs), and wrong often (rejected positions' blocks).
PERIODS = st.sampled_from([None, 2, 3, 5])


@SETTINGS
@given(st.sampled_from(["continuous", "chunked"]).flatmap(
    lambda policy: workloads(policy, speculative=True)), PERIODS)  # fmt: skip
def test_speculation_keeps_every_invariant_and_output(workload, period):
    """Proposals verified in the step: every request's tokens are exactly those
    of decoding without them, through preemption, recompute, prefix hits, windows
    and aborts in flight; rejected positions' blocks come back at once (the KV
    check fails a step that reads a block another sequence took) and nothing leaks."""
    check_workload(*workload, period=period)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["continuous", "chunked"]).flatmap(
    lambda policy: workloads(policy, speculative=True)), PERIODS)  # fmt: skip
def test_speculation_with_scheduling_ahead_through_the_codec(workload, period):
    check_workload(*workload, through_codec=True, ahead=True, period=period)
