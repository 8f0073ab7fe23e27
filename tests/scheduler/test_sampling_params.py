"""SamplingParams validation: one error type, naming the field and its range."""

from __future__ import annotations

import dataclasses
import math

import pytest

from iterserve.scheduler import SamplingParams, SamplingParamsError
from iterserve.scheduler.sampling import StructuredOutput


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
        ({"max_tokens": -1}, "max_tokens", r"\[0, "),
        ({"max_tokens": True}, "max_tokens", "integer"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", r"\[0, 8\]"),
        ({"n": 0}, "n", r"\[1, "),
        ({"seed": -1}, "seed", "got -1"),
        ({"stop_token_ids": (-5,)}, "stop_token_ids", "got -5"),
        ({"stop_token_ids": tuple(range(300))}, "stop_token_ids", "at most 256"),
        ({"ignore_eos": "yes"}, "ignore_eos", "boolean"),
        ({"logprobs": -1}, "logprobs", "got -1"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "got -1"),
        ({"logit_bias": ((5, 101.0),)}, "logit_bias", r"\[-100.0, 100.0\]"),
        ({"logit_bias": ((-5, 1.0),)}, "logit_bias", "got -5"),
        ({"logit_bias": ((5,),)}, "logit_bias", "pairs"),
        ({"logit_bias": tuple((i, 1.0) for i in range(1025))}, "logit_bias", "at most 1024"),
        ({"allowed_token_ids": ()}, "allowed_token_ids", "1 to"),
        ({"allowed_token_ids": (1, -1)}, "allowed_token_ids", "got -1"),
        ({"bad_words": ((),)}, "bad_words", "1 to 512 tokens"),
        ({"bad_words": (5,)}, "bad_words", "sequences of token ids"),
        ({"structured_output": {"kind": "yaml", "spec": "x"}}, "structured_output", "kind"),
        ({"structured_output": {"kind": "json", "spec": ""}}, "structured_output", "non-empty"),
        (
            {"structured_output": {"kind": "regex", "spec": "a" * ((1 << 20) + 1)}},
            "structured_output",
            "longer than",
        ),
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


def test_extensions_cross_as_lists_and_arrive_as_tuples():
    params = SamplingParams(
        logit_bias=[[5, 2]],
        allowed_token_ids=[1, 2],
        bad_words=[[3, 4]],
        structured_output={"kind": "json", "spec": '{"type": "object"}'},
    )
    assert params.logit_bias == ((5, 2.0),) and isinstance(params.logit_bias[0][1], float)
    assert params.allowed_token_ids == (1, 2) and params.bad_words == ((3, 4),)
    assert params.structured_output == StructuredOutput("json", '{"type": "object"}')
    assert SamplingParams(**dataclasses.asdict(params)) == params


def test_max_tokens_zero_asks_for_the_prompt_alone():
    assert SamplingParams(max_tokens=0, prompt_logprobs=2).max_tokens == 0
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(max_tokens=0, min_tokens=1)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"logit_bias": ((100, 1.0),)}, "logit_bias"),
        ({"allowed_token_ids": (99, 100)}, "allowed_token_ids"),
        ({"bad_words": ((1, 100),)}, "bad_words"),
        ({"prompt_logprobs": 6}, "prompt_logprobs"),
    ],
)
def test_extension_limits_that_depend_on_configuration(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs).check_limits(max_n=1, max_logprobs=5, vocab_size=100)
    assert info.value.field == field
