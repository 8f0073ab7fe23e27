"""Prompt logprobs and prompt-only requests (max_tokens 0) on the runner."""

from __future__ import annotations

import torch
from plan_driver import PlanDriver
from test_runner_greedy import make_runner, prompts

from iterserve.scheduler.messages import NewSequence, StepPlan
from iterserve.scheduler.sampling import SamplingParams


def collected(driver: PlanDriver) -> dict[int, object]:
    return {p.seq_id: p for result in driver.results for p in result.prompt_logprobs}


def test_prompt_logprobs_match_transformers_across_prefill_pieces(checkpoint_dir, hf_reference):
    prompt = prompts()[4]
    driver = PlanDriver(make_runner(checkpoint_dir("llama")))
    seq = driver.add("r", prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))
    other = driver.add("o", prompts()[1], SamplingParams(temperature=0.0, max_tokens=2))
    driver.run(chunk=3)  # the prompt in pieces of 3
    got = collected(driver)
    assert set(got) == {seq.slot}, "only the sequence that asked"
    assert other.slot not in got
    ref = torch.log_softmax(hf_reference("llama").logits(prompt).float(), -1)  # [len, vocab]
    entry = got[seq.slot]
    assert len(entry.token_logprobs) == len(prompt) - 1
    for pos in range(len(prompt) - 1):
        row, target = ref[pos], prompt[pos + 1]
        assert abs(entry.token_logprobs[pos] - row[target].item()) < 1e-4
        assert entry.ranks[pos] == int((row > row[target]).sum()) + 1
        assert [t for t, _ in entry.top_logprobs[pos]] == row.topk(3).indices.tolist()
    # They come with the step that samples the first token, and only then.
    (first,) = [r for r in driver.results if r.prompt_logprobs]
    assert [t.seq_id for t in first.sampled] == [seq.slot, other.slot][: len(first.sampled)]


def test_max_tokens_zero_finishes_after_the_prompt_without_a_token(checkpoint_dir):
    driver = PlanDriver(make_runner(checkpoint_dir("llama")))
    only = driver.add("only", prompts()[2], SamplingParams(max_tokens=0, prompt_logprobs=0))
    driver.add("next", prompts()[3], SamplingParams(temperature=0.0, max_tokens=3))
    out = driver.run(chunk=4)
    assert out["only"] == [] and driver.done["only"].finish_reason == "length"
    assert len(out["next"]) == 3
    assert all(t.seq_id != only.slot for r in driver.results for t in r.sampled)
    entry = collected(driver)[only.slot]
    assert len(entry.token_logprobs) == len(prompts()[2]) - 1
    assert all(top == [] for top in entry.top_logprobs)  # 0 alternatives asked for


def test_a_sequence_sent_again_with_its_output_does_not_repeat_its_prompt_logprobs(
    checkpoint_dir,
):
    runner = make_runner(checkpoint_dir("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1)
    prompt = prompts()[0]
    driver = PlanDriver(runner)
    seq = driver.add("p", prompt, params)
    driver.step()
    driver.step()
    assert len(collected(driver)) == 1
    runner.execute(StepPlan(driver.step_no, released_slots=[seq.slot]))  # preempted
    driver.step_no += 1
    tokens = list(seq.tokens)
    driver._new = [NewSequence(seq.slot, "p", seq.slot, tokens, len(prompt), params)]
    seq.computed, seq.blocks = 0, []
    driver.results.clear()
    driver.run()
    assert not collected(driver)
