"""Speculative decoding on a real model: the scheduler proposes by prompt lookup,
the runner verifies every proposal in one forward, and the output is exactly
what decoding without proposals gives (greedy, and seeded sampling), while the
tokens it does sample keep the model's distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from iterserve.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from iterserve.scheduler.messages import NewSequence, ScheduledSeq, StepPlan
from iterserve.scheduler.seq_table import SequenceTable
from iterserve.workers import ModelRunner
from iterserve.workers.sampler import Sampler
from iterserve.workers.step_params import DraftRow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


def prompts() -> list[list[int]]:
    """Prompts whose continuations repeat what came before (a random tiny model
    falls into loops, and some prompts are loops themselves), and plain ones."""
    gen = torch.Generator().manual_seed(5)
    out = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 12, 23, 40)]
    out += [[7, 8, 9, 10] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1], list(range(40, 52)) * 2]
    return out


def generate(path, params: list[SamplingParams], speculative: dict | None, *, budget=37,
             num_blocks=256, max_num_seqs=8, max_model_len=256,
             logprobs: dict[str, list] | None = None):  # fmt: skip
    """Every prompt through the scheduler and the runner, one step at a time; each
    request's logprobs into ``logprobs`` when given."""
    draft = (speculative or {}).get("model")
    runner = ModelRunner(path, dtype="float32", kernel_backend="cpu", num_kv_blocks=num_blocks,
                         block_size=4, draft_model=draft)  # fmt: skip
    config = SchedulerConfig(
        policy="chunked", max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        max_model_len=max_model_len, block_size=4, num_kv_blocks=num_blocks,
        speculative_config=speculative or {},
    )  # fmt: skip
    sched = Scheduler(config, ahead=False)
    outputs: dict[str, list[int]] = {}
    for i, (prompt, p) in enumerate(zip(prompts(), params)):
        sched.add_request(Request(f"r{i}", prompt, p))
        outputs[f"r{i}"] = []
    steps = 0
    while sched.has_work:
        step = sched.schedule(float(steps))
        assert step is not None
        for out in sched.update(runner.execute(step.plan)).outputs:
            outputs[out.request_id] += out.new_token_ids
            if logprobs is not None:
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
        sched.check_integrity()
        steps += 1
    assert sched.blocks.num_used == 0 and not runner.table.by_slot
    return outputs, sched, steps


def test_greedy_output_is_identical_and_takes_fewer_steps(checkpoint_dir, hf_reference):
    path = checkpoint_dir("llama")
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * len(prompts())
    plain, _, plain_steps = generate(path, params, None)
    spec, sched, spec_steps = generate(path, params, NGRAM)
    assert spec == plain
    hf = hf_reference("llama")
    reference = hf.greedy(prompts()[0])  # transformers' greedy tokens
    assert spec["r0"][: len(reference)] == reference
    stats = sched.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    assert spec_steps < plain_steps


def test_eos_stop_tokens_and_max_tokens_inside_an_accepted_run(checkpoint_dir):
    """A stop token or max_tokens landing mid-run ends the sequence there: the
    tokens after it are not emitted."""
    path = checkpoint_dir("llama")
    base = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(prompts())
    plain, _, _ = generate(path, base, None)
    params = []
    for i in range(len(base)):
        out = plain[f"r{i}"]
        stop = out[17 + i] if i % 2 else None  # a token it emits mid-way
        params.append(SamplingParams(temperature=0.0, max_tokens=13 + 3 * i, ignore_eos=True,
                                     stop_token_ids=() if stop is None else (stop,)))  # fmt: skip
    want, _, _ = generate(path, params, None)
    got, sched, _ = generate(path, params, NGRAM)
    assert got == want
    assert sched.spec_stats.num_accepted_tokens > 0


def test_seeded_sampling_is_identical_with_and_without_proposals(checkpoint_dir):
    """A seeded row draws output token n from the generator of (seed, n), with or
    without proposals before it: the same tokens."""
    path = checkpoint_dir("llama")
    params = [SamplingParams(temperature=0.7, top_k=20, seed=100 + i, max_tokens=40,
                             ignore_eos=True, logprobs=2) for i in range(len(prompts()))]  # fmt: skip
    plain_logprobs: dict[str, list] = {}
    spec_logprobs: dict[str, list] = {}
    plain, _, _ = generate(path, params, None, logprobs=plain_logprobs)
    spec, sched, _ = generate(path, params, NGRAM, logprobs=spec_logprobs)
    assert spec == plain
    assert sched.spec_stats.num_accepted_tokens > 0
    # Each emitted token's logprob and top alternatives are its own row's.
    assert plain_logprobs.keys() == spec_logprobs.keys()
    for request_id, want in plain_logprobs.items():
        got = spec_logprobs[request_id]
        assert len(got) == len(want) == len(plain[request_id])
        for (lp, top), (lp0, top0) in zip(got, want):
            assert lp == pytest.approx(lp0, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in top0]


def test_a_small_pool_and_budget_take_proposals_back_instead_of_preempting(checkpoint_dir):
    """Blocks and budget short: proposals give way, outputs stay exact, nothing leaks."""
    path = checkpoint_dir("llama")
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * len(prompts())
    small = dict(budget=16, num_blocks=40, max_num_seqs=4, max_model_len=96)
    plain, _, _ = generate(path, params, None, **small)
    spec, sched, _ = generate(path, params, NGRAM, **small)
    assert spec == plain
    assert sched.num_preemptions > 0 and sched.spec_stats.num_accepted_tokens > 0


# -- a draft model -------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["llama", "qwen2"])  # the target itself; another model
def test_a_draft_model_keeps_greedy_output_identical(checkpoint_dir, draft):
    """The ranks' draft model proposes, the target verifies: the target's tokens,
    in fewer steps when the draft agrees with it (itself: every proposal kept)."""
    path = checkpoint_dir("llama")
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * len(prompts())
    plain, _, plain_steps = generate(path, params, None)
    spec = {"method": "draft_model", "model": str(checkpoint_dir(draft)),
            "num_speculative_tokens": 3}  # fmt: skip
    got, sched, steps = generate(path, params, spec)
    assert got == plain
    stats = sched.spec_stats
    assert stats.num_drafts > 0
    if draft == "llama":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert steps < plain_steps


def test_a_draft_model_under_preemption_and_seeded_sampling(checkpoint_dir):
    """Blocks short (preemption, recompute: the draft's KV is rebuilt with the
    target's) and seeded sampling: the same tokens as without proposals."""
    path = checkpoint_dir("llama")
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=50, ignore_eos=True)
              for i in range(len(prompts()))]  # fmt: skip
    small = dict(budget=16, num_blocks=40, max_num_seqs=4, max_model_len=96)
    plain, _, _ = generate(path, params, None, **small)
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4}
    got, sched, _ = generate(path, params, spec, **small)
    assert got == plain
    assert sched.num_preemptions > 0 and sched.spec_stats.num_accepted_tokens > 0


def test_a_draft_of_another_vocabulary_is_refused(checkpoint_dir, tmp_path):
    import json
    import shutil

    from iterserve.workers.draft import check_draft

    target = checkpoint_dir("llama")
    other = tmp_path / "other"
    shutil.copytree(target, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 8
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="tokenizer"):
        check_draft(other, target)
    with pytest.raises(ValueError, match="no checkpoint"):
        check_draft(tmp_path / "missing", target)
    check_draft(target, target)


# -- the distribution a draft's rows sample -------------------------------------------


def chi_square_ok(counts: Counter, probs: list[float], n: int) -> bool:
    """Pearson's test at p = 0.001 for the first len(probs) - 1 degrees of freedom."""
    stat = sum((counts.get(i, 0) - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)
    dof = sum(p > 0 for p in probs) - 1
    # Wilson-Hilferty: the chi-square quantile at 0.999.
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < limit


@pytest.mark.parametrize("draft", [0, 3])  # the most likely token, and an unlikely one
def test_rejection_sampling_keeps_the_target_distribution(draft):
    """Tokens emitted from a draft's rows follow the model's distribution at each
    position, whatever was proposed: the first one always, the second given the
    first was the proposal."""
    probs0 = [0.4, 0.25, 0.15, 0.1, 0.05, 0.05]
    probs1 = [0.1, 0.1, 0.5, 0.2, 0.05, 0.05]
    logits = torch.tensor([probs0, probs1, probs1]).log()
    sampler = Sampler(frozenset({99}), "cpu", seed=1)
    params = SamplingParams(temperature=1.0, max_tokens=100, ignore_eos=True)
    first, second = Counter(), Counter()
    trials = 6000
    for t in range(trials):
        table = SequenceTable({99}, block_size=4)
        new = NewSequence(t, "s", 0, [1, 2, 3], 3, params, num_cached_tokens=2)
        entry = ScheduledSeq(0, 2, 3, [0], True, 0, [draft, 2])
        table.apply(StepPlan(step=1, new_seqs=[new], scheduled=[entry]))
        table.advance(entry)
        seq = table.get(0)
        rows = [DraftRow(seq, 3 + i) for i in range(3)]
        out = sampler(logits, rows)
        kept, _ = table.take_drafts(entry, out.token_ids)
        emitted = seq.token_ids[3:]
        assert len(emitted) == kept
        first[emitted[0]] += 1
        if emitted[0] == draft:
            second[emitted[1]] += 1
    assert chi_square_ok(first, probs0, trials)
    assert chi_square_ok(second, probs1, sum(second.values()))
    assert sum(second.values()) > 0.02 * trials
