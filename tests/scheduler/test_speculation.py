"""Speculative decoding's pure parts: the configuration, the prompt-lookup
proposer, and the rule both sides apply to a draft's rejected positions."""

from __future__ import annotations

import pytest

from iterserve.scheduler import SamplingParams, SchedulerConfig
from iterserve.scheduler.blocks import BlockManager
from iterserve.scheduler.messages import NewSequence, ScheduledSeq, StepPlan
from iterserve.scheduler.seq_table import PlanMismatchError, SequenceTable
from iterserve.scheduler.speculation import SpeculativeConfig, propose_ngram, speculable

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_vllm_keys_parse_with_vllms_defaults():
    spec = SpeculativeConfig.parse(NGRAM)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = SpeculativeConfig.parse({**NGRAM, "prompt_lookup_max": 4})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    spec = SpeculativeConfig.parse({**NGRAM, "prompt_lookup_min": 2, "enforce_eager": True})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.parse({}) is None and SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize(
    "raw, named",
    [
        ({"num_speculative_tokens": 3}, "method"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({**NGRAM, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({**NGRAM, "draft_model_path": "/x"}, "draft_model_path"),
        ({**NGRAM, "model": "/some/draft"}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ],
)
def test_bad_values_are_refused_by_name(raw, named):
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.parse(raw)


def test_policies_and_layouts_that_cannot_speculate_are_refused():
    with pytest.raises(ValueError, match="static"):
        SchedulerConfig(policy="static", speculative_config=NGRAM)
    with pytest.raises(ValueError, match="paged"):
        SchedulerConfig(kv_layout="slab", speculative_config=NGRAM)


def test_the_batch_limit_left_unset_is_the_devices():
    config = SchedulerConfig(speculative_config=NGRAM)
    cpu = config.resolved(num_kv_blocks=64, max_model_len=128, device="cpu")
    cuda = config.resolved(num_kv_blocks=64, max_model_len=128, device="cuda:0")
    assert (cpu.speculation.max_batch, cuda.speculation.max_batch) == (16, 64)
    mine = SchedulerConfig(speculative_config={**NGRAM, "disable_by_batch_size": 3})
    assert (
        mine.resolved(num_kv_blocks=64, max_model_len=128, device="cuda").speculation.max_batch == 3
    )


def test_prompt_lookup_takes_the_longest_ngram_at_its_earliest_occurrence():
    tokens = [1, 2, 3, 9, 8, 2, 3, 7, 6, 5, 1, 2, 3]
    # The 3-gram (1, 2, 3) occurs at 0: what followed it there.
    assert propose_ngram(tokens, 3, 1, 3) == [9, 8, 2]
    # Only 2-grams allowed: (2, 3) first occurs at 1.
    assert propose_ngram(tokens, 2, 1, 2) == [9, 8]
    # Fewer than k follow the match near the end.
    assert propose_ngram([5, 6, 7, 5, 6], 4, 2, 2) == [7, 5, 6]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # no earlier occurrence
    assert propose_ngram([4, 4], 3, 2, 3) == []  # too short for a 2-gram and a follower
    # Token ids above one byte: a match must start on a token, not inside one.
    big = [0x0102, 0x0304, 0x0203, 0x0102, 0x0304]
    assert propose_ngram(big, 2, 2, 2) == [0x0203, 0x0102]


def test_sampling_that_reads_its_history_does_not_speculate():
    assert speculable(SamplingParams(temperature=0.7, top_p=0.9, seed=1, logprobs=2))
    assert not speculable(SamplingParams(repetition_penalty=1.1))
    assert not speculable(SamplingParams(frequency_penalty=0.5))


def test_truncate_returns_the_blocks_of_rejected_positions():
    blocks = BlockManager(16, 4)
    blocks.allocate("a", 13)  # 4 blocks: positions up to 15
    dropped = blocks.truncate("a", 9)  # positions 0..8 kept: 3 blocks
    assert len(dropped) == 1 and len(blocks.table("a")) == 3
    assert blocks.truncate("a", 12) == []
    blocks.check_integrity()
    assert blocks.num_free == 13


def _table_with_draft(drafts: list[int], params=None):
    table = SequenceTable({2}, block_size=4)
    params = params or SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    new = NewSequence(0, "s", 0, [5, 6, 7], 3, params, num_cached_tokens=2)
    entry = ScheduledSeq(0, 2, 1 + len(drafts), [10, 11], True, 0, drafts)
    table.apply(StepPlan(step=1, new_seqs=[new], scheduled=[entry]))
    table.advance(entry)
    return table, entry


def test_a_draft_keeps_the_run_its_samples_confirm_and_drops_the_rest():
    table, entry = _table_with_draft([8, 9, 4, 4])
    seq = table.get(0)
    assert seq.token_ids == [5, 6, 7, 8, 9, 4, 4]  # the proposals are its rows' inputs
    kept, finished = table.take_drafts(entry, [8, 9, 1, 3, 3])
    assert (kept, finished) == (3, None)
    assert seq.token_ids == [5, 6, 7, 8, 9, 1]
    assert seq.num_computed_tokens == 5  # positions 0..4; the last token's KV comes next
    assert seq.block_ids == [10, 11]  # blocks_for(5) of block size 4


def test_a_stop_inside_an_accepted_run_ends_the_sequence_there():
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(9,))
    table, entry = _table_with_draft([8, 9, 4], params)
    kept, finished = table.take_drafts(entry, [8, 9, 4, 1])
    assert kept == 2 and finished.reason == "stop_token"
    assert finished.block_ids == [10, 11]  # everything it held


def test_proposals_for_a_sequence_that_cannot_speculate_are_a_plan_mismatch():
    with pytest.raises(PlanMismatchError, match="penalties"):
        _table_with_draft([8], SamplingParams(max_tokens=9, repetition_penalty=1.2))


def test_unnamed_proposals_on_a_worker_without_a_draft_model_are_a_plan_mismatch():
    table = SequenceTable({2}, block_size=4, drafts=False)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    new = NewSequence(0, "s", 0, [5, 6, 7], 3, params, num_cached_tokens=2)
    entry = ScheduledSeq(0, 2, 3, [10], True, 0, [], num_draft_tokens=2)
    with pytest.raises(PlanMismatchError, match="draft model"):
        table.apply(StepPlan(step=1, new_seqs=[new], scheduled=[entry]))


def test_a_sequence_that_cannot_speculate_decodes_beside_one_that_does():
    """With prompt lookup on, a penalised request is scheduled one token a step
    while a plain one in the same steps carries proposals; both finish."""
    from iterserve.scheduler import FakeExecutor, Request, Scheduler
    from tests.scheduler.driver import one_step, prompt_for

    sched = Scheduler(SchedulerConfig(
        policy="continuous", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
        block_size=4, num_kv_blocks=64,
        speculative_config={**NGRAM, "prompt_lookup_min": 1, "prompt_lookup_max": 2}))  # fmt: skip
    fake = FakeExecutor(vocab_size=100, output_len=None, block_size=4, period=2)
    prompt = prompt_for("p", 8)
    sched.add_request(Request("plain", prompt, SamplingParams(max_tokens=12)))
    sched.add_request(
        Request("penalised", prompt, SamplingParams(max_tokens=12, repetition_penalty=1.2))
    )
    drafts = {"plain": 0, "penalised": 0}
    finished = set()
    for _ in range(40):
        plan, outputs = one_step(sched, fake)
        if plan is None:
            break
        sched.check_integrity()
        by_slot = {r.slot_idx: r.request_id for r in sched.requests.values()}
        for entry in plan.scheduled:
            if entry.slot_idx in by_slot:
                drafts[by_slot[entry.slot_idx]] += entry.num_draft_tokens
        finished |= {o.request_id for o in outputs if o.finished}
    assert finished == {"plain", "penalised"}
    assert drafts["penalised"] == 0 and drafts["plain"] > 0
