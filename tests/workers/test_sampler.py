"""Each sampling knob does what SamplingParams says it does."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from iterserve.scheduler.sampling import SamplingParams
from iterserve.workers.sampler import Sampler

VOCAB = 32


@dataclass
class Row:
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = 0
    counts_row: int = -1
    counted: tuple[int, int] = (0, -1)


def rows_of(params: SamplingParams, n: int, prompt=(1, 2), output=()) -> list[Row]:
    ids = [*prompt, *output]
    return [Row(params, list(ids), len(prompt), i) for i in range(n)]


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sampler(eos=frozenset({0})) -> Sampler:
    return Sampler(eos, "cpu", seed=123)


def test_greedy_is_exact_argmax():
    logits = random_logits(64)
    out = sampler()(logits, rows_of(SamplingParams(temperature=0.0), 64))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_a_plain_greedy_batch_takes_the_argmax_without_per_row_parameters(monkeypatch):
    import iterserve.workers.sampler as sampler_module

    def refuse(*args, **kwargs):
        raise AssertionError("StepParams built for a plain greedy batch")

    monkeypatch.setattr(sampler_module, "StepParams", refuse)
    logits = random_logits(16)
    out = sampler()(logits, rows_of(SamplingParams(temperature=0.0, min_tokens=1), 16))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16 and out.top_logprobs == [[]] * 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_argmax_shortcut_picks_what_torch_picks_on_ties_and_nan(dtype):
    """CPU rows go through numpy's argmax (bf16 and fp16 widened to fp32 first): the
    first of equal maxima and a NaN as the largest, as torch's, and every dtype the
    same tokens as torch."""
    logits = random_logits(6).to(dtype)
    logits[1, [5, 9]] = 50.0  # a tie: the first wins
    logits[2, 7] = float("nan")
    logits[3, :] = 1.0  # a flat row: index 0
    logits[4, [2, 3]] = float("nan")
    out = sampler()(logits, rows_of(SamplingParams(temperature=0.0), 6))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[1:5] == [5, 7, 0, 2]


@pytest.mark.parametrize(
    "extra",
    [dict(logprobs=0), dict(min_tokens=2), dict(logit_bias=((3, 5.0),)),
     dict(allowed_token_ids=(4, 5)), dict(bad_words=((7,),)), dict(repetition_penalty=1.2),
     dict(presence_penalty=0.5), dict(frequency_penalty=0.5)],
    ids=lambda extra: next(iter(extra)),
)  # fmt: skip
def test_one_row_that_changes_its_logits_takes_the_whole_batch_down_the_full_path(
    monkeypatch, extra
):
    """Each setting the argmax shortcut must not skip: with it on one row the batch
    builds its parameters, that row gets what the full path gives it alone, and the
    plain rows are still their argmax."""
    import iterserve.workers.sampler as sampler_module

    built = []
    step_params = sampler_module.StepParams
    monkeypatch.setattr(
        sampler_module, "StepParams", lambda *a, **k: built.append(1) or step_params(*a, **k)
    )
    plain = SamplingParams(temperature=0.0)
    special = SamplingParams(temperature=0.0, **extra)
    assert plain.takes_argmax and not special.takes_argmax
    logits = random_logits(4, seed=1)
    mixed = rows_of(plain, 3, output=(7,)) + rows_of(special, 1, output=(7,))
    got = sampler()(logits, mixed)
    assert built
    alone = sampler()(logits[3:], rows_of(special, 1, output=(7,)))
    assert got.token_ids[:3] == logits[:3].argmax(-1).tolist()
    assert got.token_ids[3] == alone.token_ids[0]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)],
    ids=["top_k=1", "tiny top_p"],
)
def test_filters_down_to_one_token_are_greedy(params):
    logits = random_logits(256)
    out = sampler()(logits, rows_of(params, 256))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_temperature_draws_follow_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-1e9] * (VOCAB - 4)])
    n = 20_000
    out = sampler()(logits.expand(n, -1), rows_of(SamplingParams(temperature=0.7), n))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB)[:4].float() / n
    torch.testing.assert_close(freq, torch.softmax(logits[0, :4] / 0.7, -1), atol=0.015, rtol=0)


def test_top_k_keeps_the_k_best():
    logits = random_logits(1).expand(4000, -1)
    out = sampler()(logits, rows_of(SamplingParams(top_k=3, temperature=2.0), 4000))
    assert set(out.token_ids) == set(logits[0].topk(3).indices.tolist())


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-12] * (VOCAB - 4)]))
    out = sampler()(logits.expand(4000, -1), rows_of(SamplingParams(top_p=0.8), 4000))
    # 0.5 + 0.3 reaches 0.8: exactly the first two survive.
    assert set(out.token_ids) == {0, 1}


def test_min_p_drops_tokens_below_the_floor():
    probs = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05] + [0.0] * (VOCAB - 5)])
    logits = torch.log(probs.clamp_min(1e-12))
    out = sampler()(logits.expand(4000, -1), rows_of(SamplingParams(min_p=0.3), 4000))
    # floor = 0.3 * 0.4 = 0.12
    assert set(out.token_ids) == {0, 1, 2}


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0] + [0.0] * (VOCAB - 4)])
    # token 0 in the prompt, token 1 in the output: both count; 2 and 3 are unseen.
    row = Row(SamplingParams(repetition_penalty=2.0), [0, 1], 1)
    got = sampler().process(logits, [row])[0, :4]
    assert got.tolist() == [1.0, -4.0, 2.0, -2.0]


def test_presence_and_frequency_penalties_count_output_only():
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = Row(params, [3, 3, 4, 4, 4, 5], 2)  # prompt [3, 3]; output 4, 4, 4, 5
    got = sampler().process(logits, [row])[0]
    assert got[3] == 0.0
    assert got[4] == pytest.approx(-(0.5 + 3 * 0.25))
    assert got[5] == pytest.approx(-(0.5 + 1 * 0.25))
    assert (got[6:] == 0).all()


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 0] = 5.0  # EOS
    logits[0, 7] = 4.0  # stop token
    logits[0, 9] = 3.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(7,))
    s = sampler()
    # outputs so far: 0 and 1 -> the next token could not end the sequence
    assert s(logits, [Row(params, [1], 1)]).token_ids == [9]
    assert s(logits, [Row(params, [1, 9], 1)]).token_ids == [9]
    # the third output token may stop it (SequenceTable's rule)
    assert s(logits, [Row(params, [1, 9, 9], 1)]).token_ids == [0]
    ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert s(logits, [Row(ignore, [1], 1)]).token_ids == [0]


def test_logprobs_are_raw_log_softmax():
    logits = random_logits(3)
    params = [
        SamplingParams(temperature=0.0, logprobs=4),
        SamplingParams(temperature=0.0, logprobs=None),
        SamplingParams(temperature=1.0, logprobs=0, repetition_penalty=1.5),
    ]
    rows = [Row(p, [1, 2], 1, i) for i, p in enumerate(params)]
    out = sampler()(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[0] == pytest.approx(ref[0].max().item(), abs=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == ref[0].topk(4).indices.tolist()
    for token, lp in out.top_logprobs[0]:
        assert lp == pytest.approx(ref[0, token].item(), abs=1e-6)
    assert out.logprobs[1] is None and out.top_logprobs[1] == []
    assert out.logprobs[2] == pytest.approx(ref[2, out.token_ids[2]].item(), abs=1e-6)
    assert out.top_logprobs[2] == []


def test_seeded_rows_ignore_their_batch_neighbours():
    logits = random_logits(1).expand(5, -1)
    seeded = SamplingParams(temperature=1.0, seed=42)
    s_alone, s_batched = sampler(), sampler()
    alone = []
    batched = []
    row_alone, row_batched = Row(seeded, [1], 1, 201), Row(seeded, [1], 1, 201)
    for _ in range(20):
        alone.append(s_alone(logits[:1], [row_alone]).token_ids[0])
        others = [Row(SamplingParams(temperature=1.0), [1], 1, 100 + i) for i in range(3)]
        mixed = [others[0], row_batched, *others[1:], Row(seeded, [1], 1, 202)]
        batched.append(s_batched(logits, mixed).token_ids[1])
        row_alone.token_ids.append(alone[-1])
        row_batched.token_ids.append(batched[-1])
    assert alone == batched
    assert len(set(alone)) > 1


def naive_penalties(logits, row):
    """Steps 2-3 recomputed from the token lists, as a reference."""
    p, out = row.params, logits.clone()
    ids = row.token_ids
    outputs = ids[row.num_prompt_tokens :]
    for t in set(ids):
        if p.repetition_penalty != 1.0:
            v = out[0, t]
            out[0, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for t in set(outputs):
        out[0, t] -= p.frequency_penalty * outputs.count(t) + p.presence_penalty
    return out


def test_device_token_counts_follow_the_sequence():
    """Counts live on the device and advance with each drawn token; a row whose
    tokens no longer match what was counted (a re-sent request) is rebuilt."""
    params = SamplingParams(
        temperature=1.0, repetition_penalty=1.7, presence_penalty=0.3, frequency_penalty=0.2
    )
    s = sampler()
    row = Row(params, [3, 5, 5], 2, "p")
    for step in range(12):
        logits = random_logits(1, seed=step)
        torch.testing.assert_close(s.process(logits, [row]), naive_penalties(logits, row))
        row.token_ids.append(s(logits, [row]).token_ids[0])
    s.release(row)
    row = Row(params, [9, 9, 1, 2, 2], 3, "p")
    torch.testing.assert_close(s.process(logits, [row]), naive_penalties(logits, row))
    # Other tokens of the same length under the same row: rebuilt, not trusted.
    row.token_ids[-1] = 7
    torch.testing.assert_close(s.process(logits, [row]), naive_penalties(logits, row))


def test_top_k_without_a_sort_keeps_what_the_sort_keeps():
    from iterserve.workers.sampler import _filter

    logits = random_logits(5, seed=4)
    params = [SamplingParams(top_k=k) for k in (1, 3, 0, 31, 40)]
    rows = [Row(p, [1], 1, f"k{i}") for i, p in enumerate(params)]
    s = sampler()
    got = _filter(logits, params, s.step_params(rows, VOCAB, None))
    for i, k in enumerate((1, 3, 0, 31, 40)):
        if not 0 < k < VOCAB:
            assert torch.equal(got[i], logits[i])
            continue
        kept = torch.isfinite(got[i]).nonzero().flatten().tolist()
        assert sorted(kept) == sorted(logits[i].topk(k).indices.tolist())
        assert torch.equal(got[i, kept], logits[i, kept])


def test_logit_bias_is_added_to_the_logits_it_names():
    logits = random_logits(2, seed=5)
    params = SamplingParams(temperature=0.0, logit_bias=((3, 100.0), (4, -2.5)))
    got = sampler().process(logits, rows_of(params, 2))
    want = logits.clone()
    want[:, 3] += 100.0
    want[:, 4] -= 2.5
    torch.testing.assert_close(got, want)
    out = sampler()(logits, rows_of(params, 2))
    assert out.token_ids == [3, 3]  # +100 wins the argmax


def test_allowed_token_ids_leave_only_those_tokens():
    logits = random_logits(300, seed=6)
    allowed = (2, 9, 17)
    rows = rows_of(SamplingParams(temperature=1.0, allowed_token_ids=allowed), 200)
    rows += rows_of(SamplingParams(temperature=1.0), 100)  # unconstrained rows keep their logits
    out = sampler()(logits, rows)
    assert set(out.token_ids[:200]) <= set(allowed)
    processed = sampler().process(logits, rows)
    assert torch.equal(processed[200:], logits[200:])
    assert torch.isinf(processed[:200]).sum().item() == 200 * (VOCAB - 3)


def test_bad_words_ban_their_last_token_where_the_output_leads_into_it():
    logits = torch.zeros(3, VOCAB)
    words = ((5,), (7, 8), (1, 2, 9))
    params = SamplingParams(temperature=0.0, bad_words=words)
    rows = [
        Row(params, [1, 2], 2),  # no output: only the one-token word is banned
        Row(params, [1, 2, 7], 2),  # the output ends in 7: 8 is banned too
        Row(params, [4, 1, 2], 1),  # 1 2 end the output: 9 is banned too
    ]
    banned = [torch.isinf(r).nonzero().flatten().tolist() for r in sampler().process(logits, rows)]
    assert banned == [[5], [5, 8], [5, 9]]


def test_a_grammar_mask_bans_every_token_its_bits_leave_out():
    from iterserve.workers.grammar import GrammarMask

    logits = random_logits(3, seed=7)
    bitmask = torch.zeros(3, 1, dtype=torch.int32)
    bitmask[0, 0] = (1 << 4) | (1 << 6)  # row 0 may sample 4 or 6
    bitmask[1, 0] = 0  # not a row of the mask: left alone
    bitmask[2, 0] = -1  # all 32 bits: everything
    rows = rows_of(SamplingParams(temperature=0.0), 3)
    got = sampler().process(logits, rows, GrammarMask(bitmask, [0, 2]))
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [4, 6]
    assert torch.equal(got[1:], logits[1:])
    out = sampler()(logits, rows, GrammarMask(bitmask, [0, 2]))
    assert out.token_ids[0] == (4 if logits[0, 4] > logits[0, 6] else 6)


def _seeded_tokens(s: Sampler, logits, row: Row, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = s(logits, [row]).token_ids[0]
        row.token_ids.append(token)
        out.append(token)
    return out


def test_a_seeded_row_resumes_its_random_stream_after_being_forgotten():
    """A preempted (or restarted) sequence comes back with the tokens it produced:
    its next draws continue its random stream where they stopped, instead of
    restarting it and drawing its first tokens' numbers again."""
    logits = torch.zeros(1, VOCAB)  # every token equally likely: the draws alone decide
    params = SamplingParams(temperature=1.0, seed=42)
    straight = _seeded_tokens(sampler(), logits, Row(params, [1], 1, 7), 8)

    s = sampler()
    row = Row(params, [1], 1, 7)
    first = _seeded_tokens(s, logits, row, 4)
    s.release(row)  # preempted: the rank drops the sequence; it comes back with its tokens
    again = _seeded_tokens(s, logits, Row(params, list(row.token_ids), 1, 7), 4)
    restarted = Row(params, [1, *first], 1, 7)  # a fresh rank after a worker restart
    assert first + again == straight
    assert _seeded_tokens(sampler(), logits, restarted, 4) == straight[4:]
    assert len(set(straight)) > 2
