"""Prefix caching: full blocks shared by content, kept until a fresh block needs them."""

from __future__ import annotations

import pytest

from iterserve.scheduler import (
    FakeExecutor,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from iterserve.scheduler.block_hash import prompt_block_hashes
from tests.scheduler.driver import one_step, prompt_for

BS = 4
PROMPT = prompt_for("system", 10)  # two full blocks and a partial one


def make(policy="continuous", **kw) -> Scheduler:
    config = dict(
        policy=policy,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=48,
        block_size=BS,
        num_kv_blocks=64,
        batch_timeout_s=0.0,
        batch_wait_s=0.0,
    )
    config.update(kw)
    return Scheduler(SchedulerConfig(**config))


def fake(**kw) -> FakeExecutor:
    return FakeExecutor(output_len=None, block_size=BS, check_kv=True, **kw)


def req(request_id: str, prompt: list[int], max_tokens: int = 4, **kw) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens), **kw)


def drain(sched: Scheduler, executor: FakeExecutor, plans: list | None = None) -> dict:
    """Runs to the end one step at a time; returns each request's outputs."""
    outputs: dict[str, list] = {}
    while sched.has_work:
        plan, outs = one_step(sched, executor)
        sched.check_integrity()
        if plans is not None and plan is not None:
            plans.append(plan)
        for out in outs:
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens(outs) -> list[int]:
    return [t for out in outs for t in out.new_token_ids]


def new_seq(plans, request_id: str):
    return next(n for p in plans for n in p.new_seqs if n.label == request_id)


def first_entry(plans, new):
    for plan in plans:
        if new in plan.new_seqs:
            return next(e for e in plan.scheduled if e.slot_idx == new.slot_idx)
    raise AssertionError("never scheduled")


def test_a_prompt_starting_with_cached_blocks_computes_only_the_rest():
    sched, executor = make(), fake()
    sched.add_request(req("a", PROMPT))
    plans: list = []
    drain(sched, executor, plans)
    a_blocks = first_entry(plans, new_seq(plans, "a")).new_block_ids
    assert sched.blocks.num_used == 0 and sched.blocks.num_cached >= 2  # kept, evictable
    sched.add_request(req("b", PROMPT[:8] + [90, 91, 92]))
    outs = drain(sched, executor, plans)
    new = new_seq(plans, "b")
    entry = first_entry(plans, new)
    assert new.num_cached_tokens == 8
    assert entry.start_pos == 8 and entry.num_tokens == 3
    assert entry.new_block_ids[:2] == a_blocks[:2]  # the cached blocks come first
    assert tokens(outs["b"]) == executor.expected_output("b", SamplingParams(max_tokens=4))[0]
    assert outs["b"][0].num_cached_tokens == 8  # on the first output only
    assert all(out.num_cached_tokens is None for out in outs["b"][1:])
    stats = sched.stats()
    assert stats["prefix_cache_hits"] == 8
    assert stats["prefix_cache_queries"] == len(PROMPT) + 11


def test_a_prompt_found_whole_still_computes_its_last_token():
    sched, executor = make(), fake()
    prompt = PROMPT[:8]  # exactly two blocks
    sched.add_request(req("a", prompt))
    drain(sched, executor)
    sched.add_request(req("b", prompt))
    plans: list = []
    drain(sched, executor, plans)
    new = new_seq(plans, "b")
    # Block 1 holds the last token, which must be computed to sample: not reused.
    assert new.num_cached_tokens == 4
    assert first_entry(plans, new).num_tokens == 4


def test_a_partial_block_is_never_shared():
    sched, executor = make(), fake()
    sched.add_request(req("a", PROMPT[:6]))
    drain(sched, executor)
    sched.add_request(req("b", PROMPT[:7]))
    plans: list = []
    drain(sched, executor, plans)
    assert new_seq(plans, "b").num_cached_tokens == 4


def test_choices_of_one_prompt_admitted_together_share_its_blocks():
    """n > 1: the choices are requests of the same prompt arriving at once. The
    first computes the prompt's full blocks; the others start on them in the
    same step (a rank writes every entry's KV before any entry attends)."""
    sched, executor = make(), fake()
    for j in range(3):
        sched.add_request(req(f"c{j}", PROMPT, max_tokens=6))
    plan, _ = one_step(sched, executor)
    cached = [n.num_cached_tokens for n in plan.new_seqs]
    assert cached == [0, 8, 8]
    # 3 blocks for the first, then only a partial third block for each other one.
    assert sched.blocks.num_used == 3 + 2 * 1
    outs = drain(sched, executor)
    for j in range(3):
        expected, _ = executor.expected_output(f"c{j}", SamplingParams(max_tokens=6))
        assert tokens(outs[f"c{j}"]) == expected[1:]


def test_with_the_cache_off_every_prompt_is_computed_from_token_0():
    sched, executor = make(enable_prefix_caching=False), fake()
    plans: list = []
    for name in ("a", "b"):
        sched.add_request(req(name, PROMPT))
        drain(sched, executor, plans)
    assert [n.num_cached_tokens for p in plans for n in p.new_seqs] == [0, 0]
    assert sched.blocks.num_cached == 0 and not sched.stats()["prefix_caching"]


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_static_and_dynamic_batching_never_share(policy):
    sched, executor = make(policy, max_num_batched_tokens=256), fake()
    plans: list = []
    for name in ("a", "b"):
        sched.add_request(req(name, PROMPT))
        drain(sched, executor, plans)
    assert not sched.config.prefix_caching
    assert [n.num_cached_tokens for p in plans for n in p.new_seqs] == [0, 0]


def test_evictable_blocks_stay_until_fresh_ones_run_out_then_go_least_recent_first():
    sched, executor = make(num_kv_blocks=7, max_model_len=24), fake()
    for name in ("old", "new"):
        sched.add_request(req(name, prompt_for(name, 8), max_tokens=1))
        drain(sched, executor)
    assert sched.blocks.num_cached == 4 and sched.blocks.num_free == 7
    # Twenty tokens take five fresh blocks: the three never hashed first, then the
    # evictable ones released longest ago: "old"'s.
    sched.add_request(req("big", prompt_for("big", 20), max_tokens=1))
    drain(sched, executor)
    assert sched.blocks.num_evictions == 2
    cached = {
        name: sched.prefix.cached_tokens(prompt_for(name, n))
        for name, n in (("old", 8), ("new", 8), ("big", 20))
    }
    assert cached == {"old": 0, "new": 8, "big": 20}


def test_a_preempted_request_resumes_after_its_blocks_still_cached():
    # Two requests whose decodes outgrow the cache: the later one is preempted, and
    # recomputed from its cached full blocks when it comes back.
    sched, executor = make(max_num_seqs=2, num_kv_blocks=9, max_model_len=20), fake()
    sched.add_request(req("a", prompt_for("a", 8), max_tokens=10, arrival_time=0.0))
    sched.add_request(req("b", prompt_for("b", 8), max_tokens=10, arrival_time=1.0))
    plans: list = []
    outs = drain(sched, executor, plans)
    assert sched.num_preemptions >= 1
    readmitted = [n for p in plans for n in p.new_seqs if n.label == "b"][1:]
    assert readmitted and readmitted[0].num_cached_tokens > 0
    # Recompute is what the cache no longer held, not everything b had computed.
    assert sched.num_recomputed_tokens < sum(len(n.token_ids) - 1 for n in readmitted)
    for name in ("a", "b"):
        expected, _ = executor.expected_output(name, SamplingParams(max_tokens=10))
        assert tokens(outs[name]) == expected
    # First outputs report the prompt tokens the first admission found: none here.
    assert outs["b"][0].num_cached_tokens == 0


def test_lost_workers_take_every_hash_with_them():
    sched, executor = make(), fake()
    outs: dict[str, list] = {}

    def take(outputs):
        for out in outputs:
            outs.setdefault(out.request_id, []).append(out)

    sched.add_request(req("a", PROMPT, max_tokens=8))
    take(one_step(sched, executor)[1])
    sched.add_request(req("b", PROMPT, max_tokens=8))
    take(one_step(sched, executor)[1])
    assert sched.blocks.num_cached >= 2
    sched.schedule(0.0)  # in flight when the ranks die
    sched.requeue_running()
    assert sched.blocks.num_cached == 0 and sched.blocks.num_used == 0
    sched.check_integrity()
    fresh = fake()  # new workers, an empty KV cache
    plans: list = []
    for request_id, more in drain(sched, fresh, plans).items():
        outs.setdefault(request_id, []).extend(more)
    # Both recomputed; the second again on the blocks the first computes.
    assert [n.num_cached_tokens for n in plans[0].new_seqs] == [0, 8]
    for name in ("a", "b"):
        expected, _ = fresh.expected_output(name, SamplingParams(max_tokens=8))
        assert tokens(outs[name]) == expected


def test_aborting_one_sharer_keeps_the_shared_blocks_for_the_other():
    sched, executor = make(), fake()
    sched.add_request(req("a", PROMPT, max_tokens=12))
    sched.add_request(req("b", PROMPT, max_tokens=12))
    outs: dict[str, list] = {}
    for _ in range(2):
        for out in one_step(sched, executor)[1]:
            outs.setdefault(out.request_id, []).append(out)
    shared = sched.blocks.table("a")[:2]
    assert sched.blocks.table("b")[:2] == shared
    sched.abort("a")
    assert all(sched.blocks.ref_counts[b] == 1 for b in shared)
    sched.check_integrity()
    # The same id again, while b still holds the blocks: a new request on them.
    sched.add_request(req("a", PROMPT, max_tokens=12))
    plans: list = []
    for request_id, more in drain(sched, executor, plans).items():
        outs.setdefault(request_id, []).extend(more)
    assert new_seq(plans, "a").num_cached_tokens == 8
    expected, _ = executor.expected_output("b", SamplingParams(max_tokens=12))
    assert tokens(outs["b"]) == expected
    expected, _ = executor.expected_output("a", SamplingParams(max_tokens=12))
    assert tokens(outs["a"])[-len(expected) :] == expected
    assert sched.blocks.num_used == 0


def test_a_salt_keeps_equal_prompts_apart():
    sched, executor = make(), fake()
    sched.add_request(req("a", PROMPT, cache_salt="tenant-1"))
    drain(sched, executor)
    plans: list = []
    sched.add_request(req("b", PROMPT, cache_salt="tenant-2"))
    sched.add_request(req("c", PROMPT, cache_salt="tenant-1"))
    drain(sched, executor, plans)
    assert [n.num_cached_tokens for p in plans for n in p.new_seqs] == [0, 8]


def test_a_router_hashes_prompts_as_the_scheduler_does():
    sched, executor = make(), fake()
    request = req("a", PROMPT)
    assert prompt_block_hashes(PROMPT, BS) == request.full_block_hashes(BS)
    assert prompt_block_hashes(PROMPT, BS, max_blocks=1) == request.full_block_hashes(BS)[:1]
    assert prompt_block_hashes(PROMPT, BS, salt="x") != request.full_block_hashes(BS)
    assert sched.prefix.cached_tokens(PROMPT) == 0
    sched.add_request(request)
    drain(sched, executor)
    assert sched.prefix.cached_tokens(PROMPT) == 8
    assert sched.prefix.cached_tokens(PROMPT[:4] + [1, 2, 3, 4]) == 4
    assert sched.prefix.cached_tokens(PROMPT, cache_salt="x") == 0


def test_a_plan_built_ahead_admits_on_cached_blocks():
    sched, executor = make(), fake()
    sched.add_request(req("a", PROMPT, max_tokens=8))
    first = sched.schedule(0.0)
    sched.add_request(req("b", PROMPT, max_tokens=8))
    ahead = sched.schedule(0.0)  # built while the first step runs
    assert ahead.plan.ahead
    assert [n.num_cached_tokens for n in ahead.plan.new_seqs] == [8]
    results = [executor.execute(first.plan), executor.execute(ahead.plan)]
    sched.update(results[0])
    sched.update(results[1])
    sched.check_integrity()
    drain(sched, executor)
    assert sched.blocks.num_used == 0
    assert sched.requests == {} and all(
        r.status != RequestStatus.RUNNING for r in sched.running.values()
    )


def test_a_prompt_asking_for_its_logprobs_is_computed_whole():
    """Prompt logprobs come from the prompt's logits: a cached block has none."""
    sched, executor = make(), fake()
    sched.add_request(req("a", PROMPT))
    drain(sched, executor)
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    sched.add_request(Request("b", list(PROMPT), params))
    plans: list = []
    outs = drain(sched, executor, plans)
    new = new_seq(plans, "b")
    assert new.num_cached_tokens == 0 and first_entry(plans, new).start_pos == 0
    assert outs["b"][0].num_cached_tokens == 0
