"""SamplingParams validation: one error type, naming the field and its range."""

from __future__ import annotations

import math

import pytest

from iterserve.scheduler import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    "kwargs, field, pattern",
    [
        ({"temperature": math.nan}, "temperature", "finite"),
        ({"temperature": math.inf}, "temperature", "finite"),
        ({"temperature": 2.5}, "temperature", r"\[0.0, 2.0\]"),
        ({"temperature": -0.1}, "temperature", r"\[0.0, 2.0\]"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"top_p": 0.0}, "top_p", r"\(0.0, 1.0\]"),
        ({"top_p": 1.5}, "top_p", r"\(0.0, 1.0\]"),
        ({"top_k": -1}, "top_k", "got -1"),
        ({"top_k": 1.5}, "top_k", "integer"),
        ({"min_p": 1.1}, "min_p", r"\[0.0, 1.0\]"),
        ({"presence_penalty": 3}, "presence_penalty", r"\[-2.0, 2.0\]"),
        ({"frequency_penalty": -3}, "frequency_penalty", r"\[-2.0, 2.0\]"),
        ({"repetition_penalty": 0}, "repetition_penalty", r"\(0.0, 2.0\]"),
        ({"max_tokens": 0}, "max_tokens", r"\[1, "),
        ({"max_tokens": True}, "max_tokens", "integer"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", r"\[0, 8\]"),
        ({"n": 0}, "n", r"\[1, "),
        ({"seed": -1}, "seed", "got -1"),
        ({"stop_token_ids": (-5,)}, "stop_token_ids", "got -5"),
        ({"stop_token_ids": tuple(range(300))}, "stop_token_ids", "at most 256"),
        ({"ignore_eos": "yes"}, "ignore_eos", "boolean"),
        ({"logprobs": -1}, "logprobs", "got -1"),
    ],
)
def test_out_of_range_values_name_the_field_and_range(kwargs, field, pattern):
    with pytest.raises(SamplingParamsError, match=pattern) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}:")


def test_defaults_and_greedy():
    assert not SamplingParams().greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)


def test_limits_that_depend_on_configuration():
    SamplingParams(n=4, logprobs=5).check_limits(max_n=4, max_logprobs=5)
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(500,)).check_limits(max_n=1, max_logprobs=0, vocab_size=100)
