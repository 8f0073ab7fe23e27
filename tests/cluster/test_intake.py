"""What an engine refuses in a request from the wire, before its scheduler sees it:
the client's record (``engine_request``), the strict codec, then the engine's
own checks (``checked_request``)."""

from __future__ import annotations

import pytest

from iterserve.cluster.engine.connection import add_message, engine_request
from iterserve.cluster.engine.errors import InvalidRequestError
from iterserve.cluster.engine.intake import checked_request
from iterserve.cluster.framing import HEADER
from iterserve.scheduler import SamplingParamsError, SchedulerConfig, codec
from iterserve.scheduler.messages import DEFAULT_TENANT, EngineRequest

LIMITS = SchedulerConfig(max_n=4, max_logprobs=5)
REFUSED = (InvalidRequestError, ValueError, SamplingParamsError)


def _check(**overrides):
    """The client's ADD frame, decoded as the engine decodes it, then checked."""
    wire = dict(key="k1", label="client-1", prompt=[1, 2], params={"max_tokens": 3}, priority=0)
    wire.update(overrides)
    frame = add_message(**wire)
    decoded = codec.decode(frame[HEADER.size + 1 :], EngineRequest)
    assert decoded == engine_request(**wire)  # the record crosses the wire whole
    return checked_request(decoded, limits=LIMITS, vocab_size=100)


def test_a_well_formed_request_passes_with_its_label_priority_and_tenant():
    request = _check(priority=-2, label="mine")
    assert (request.request_id, request.label, request.priority) == ("k1", "mine", -2)
    assert request.tenant == DEFAULT_TENANT and request.ttft_deadline is None
    request = _check(params={"max_tokens": 3, "tenant": "team-a", "slo_ttft_ms": 250})
    assert request.tenant == "team-a"
    assert request.ttft_deadline == pytest.approx(request.arrival_time + 0.25)


@pytest.mark.parametrize("priority", ["high", 1.5, True, None, 1 << 70])
def test_a_priority_that_is_not_a_small_integer_is_refused_by_name(priority):
    with pytest.raises(REFUSED, match="priority"):
        _check(priority=priority)


@pytest.mark.parametrize("label", [42, None, b"bytes", ["a"], "x" * 10_000])
def test_a_label_that_is_not_a_short_string_is_refused_by_name(label):
    with pytest.raises(REFUSED, match="label"):
        _check(label=label)


@pytest.mark.parametrize("tenant", [42, None, ["a"], "", "x" * 129])
def test_a_tenant_that_is_not_a_short_string_is_refused_by_name(tenant):
    with pytest.raises(REFUSED, match="tenant"):
        _check(params={"max_tokens": 3, "tenant": tenant})


@pytest.mark.parametrize("slo", ["fast", 0, -5.0, 1e12, True])
def test_a_first_token_target_that_is_not_a_sane_number_is_refused_by_name(slo):
    with pytest.raises(REFUSED, match="slo_ttft_ms"):
        _check(params={"max_tokens": 3, "slo_ttft_ms": slo})


@pytest.mark.parametrize(
    "overrides",
    [
        {"prompt": "abc"},
        {"prompt": [1, "2"]},
        {"prompt": [1, 500]},  # past the vocabulary
        {"params": {"max_tokens": "3"}},
        {"params": {"unknown_knob": 1}},
        {"key": ""},
    ],
)
def test_other_malformed_wire_values_are_refused_not_raised_elsewhere(overrides):
    with pytest.raises(REFUSED):
        _check(**overrides)


def test_what_the_codec_would_refuse_is_refused_by_the_client_by_name():
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        add_message("k", "l", [1, 2.5], {}, 0)
