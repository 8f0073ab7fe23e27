"""The usage object: prompt tokens cached, counted once per prompt as its tokens are."""

from __future__ import annotations

from iterserve.cluster.openai.bodies import cached_prompt_tokens, usage
from iterserve.cluster.openai.generation import Choice


def choice(index: int, cached: int | None) -> Choice:
    c = Choice(index, detokenizer=None, stops=(), logprobs=False)
    c.num_cached_tokens = cached
    return c


def test_cached_tokens_are_those_of_each_prompts_first_choice():
    # Two prompts with n=2: the second choice of a prompt may find what the first computed.
    choices = [choice(0, 0), choice(1, 16), choice(2, 8), choice(3, 24)]
    assert cached_prompt_tokens(choices, n=2) == 0 + 8


def test_a_choice_that_never_reported_leaves_the_count_to_the_next():
    assert cached_prompt_tokens([choice(0, None), choice(1, 4)], n=2) == 4
    assert cached_prompt_tokens([choice(0, None)], n=1) is None


def test_usage_names_cached_tokens_only_when_known():
    assert usage(5, 2) == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert usage(5, 2, 4)["prompt_tokens_details"] == {"cached_tokens": 4}
