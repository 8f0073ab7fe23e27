"""What an engine refuses in a request from the wire, before its scheduler sees it."""

from __future__ import annotations

import pytest

from iterserve.cluster.engine.intake import checked_request
from iterserve.scheduler import SamplingParamsError, SchedulerConfig

LIMITS = SchedulerConfig(max_n=4, max_logprobs=5)


def _check(**overrides):
    wire = dict(request_id="k1", prompt_token_ids=[1, 2], params={"max_tokens": 3})
    wire.update(overrides)
    options = {"priority": wire.pop("priority", 0), "label": wire.pop("label", "client-1")}
    return checked_request(**wire, **options, limits=LIMITS, vocab_size=100)


def test_a_well_formed_request_passes_with_its_label_and_priority():
    request = _check(priority=-2, label="mine")
    assert (request.request_id, request.label, request.priority) == ("k1", "mine", -2)


@pytest.mark.parametrize("priority", ["high", 1.5, True, None, 1 << 70])
def test_a_priority_that_is_not_a_small_integer_is_refused_by_name(priority):
    with pytest.raises((ValueError, TypeError), match="priority"):
        _check(priority=priority)


@pytest.mark.parametrize("label", [42, None, b"bytes", ["a"], "x" * 10_000])
def test_a_label_that_is_not_a_short_string_is_refused_by_name(label):
    with pytest.raises((ValueError, TypeError), match="label"):
        _check(label=label)


@pytest.mark.parametrize(
    "overrides",
    [
        {"prompt_token_ids": "abc"},
        {"prompt_token_ids": [1, "2"]},
        {"params": {"max_tokens": "3"}},
        {"params": {"unknown_knob": 1}},
        {"request_id": 7},
    ],
)
def test_other_malformed_wire_values_are_refused_not_raised_elsewhere(overrides):
    with pytest.raises((ValueError, TypeError, SamplingParamsError)):
        _check(**overrides)
