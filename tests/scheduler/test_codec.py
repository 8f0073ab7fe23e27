"""The msgpack codec: round trips, and bad bytes raise only CodecError."""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.scheduler.codec import VERSION, CodecError, decode, encode
from iterserve.scheduler.messages import (
    FINISH_REASONS,
    AdapterLoad,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    FinishedSeq,
    NewSequence,
    PooledOutput,
    PromptLogprobs,
    SampledToken,
    ScheduledSeq,
    StepPlan,
    StepResult,
)
from iterserve.scheduler.sampling import GRAMMAR_KINDS, SamplingParams, StructuredOutput

ints = st.integers(0, 2**31 - 1)
params = st.builds(
    SamplingParams,
    temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(0, 100),
    max_tokens=st.integers(1, 1000),
    seed=st.one_of(st.none(), ints),
    stop_token_ids=st.lists(ints, max_size=4).map(tuple),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
    logit_bias=st.lists(st.tuples(ints, st.floats(-100, 100)), max_size=4).map(tuple),
    allowed_token_ids=st.one_of(st.none(), st.lists(ints, min_size=1, max_size=4).map(tuple)),
    bad_words=st.lists(st.lists(ints, min_size=1, max_size=3).map(tuple), max_size=3).map(tuple),
    prompt_logprobs=st.one_of(st.none(), st.integers(0, 20)),
    structured_output=st.one_of(
        st.none(),
        st.builds(
            StructuredOutput,
            kind=st.sampled_from(GRAMMAR_KINDS),
            spec=st.text(min_size=1, max_size=80),
            start_after=st.one_of(st.none(), ints),
        ),
    ),
)
plans = st.builds(
    StepPlan,
    step=ints,
    new_seqs=st.lists(
        st.builds(
            NewSequence,
            seq_id=ints,
            label=st.text(max_size=40),
            slot_idx=ints,
            token_ids=st.lists(ints, max_size=50),
            num_prompt_tokens=ints,
            params=params,
            num_cached_tokens=ints,
            lora_slot=ints,
        ),
        max_size=4,
    ),
    scheduled=st.lists(
        st.builds(
            ScheduledSeq,
            slot_idx=ints,
            start_pos=ints,
            num_tokens=ints,
            new_block_ids=st.lists(ints, max_size=8),
            sample=st.booleans(),
            num_pad_tokens=ints,
        ),
        max_size=8,
    ),
    released_slots=st.lists(ints, max_size=8),
    padding_slots=st.lists(ints, max_size=8),
    ahead=st.booleans(),
    adapter_loads=st.lists(
        st.builds(
            AdapterLoad,
            slot=ints,
            adapter_id=ints,
            name=st.text(max_size=20),
            path=st.text(max_size=60),
        ),
        max_size=3,
    ),  # fmt: skip
)
floats = st.floats(allow_nan=False)
results = st.builds(
    StepResult,
    step=ints,
    sampled=st.lists(
        st.builds(
            SampledToken,
            seq_id=ints,
            token_id=ints,
            logprob=st.one_of(st.none(), floats),
            top_logprobs=st.lists(st.tuples(ints, floats), max_size=5),
        ),
        max_size=8,
    ),
    finished=st.lists(
        st.builds(
            FinishedSeq,
            seq_id=ints,
            reason=st.sampled_from(["eos", "stop_token", "length"]),
            block_ids=st.lists(ints, max_size=8),
        ),
        max_size=4,
    ),
    forward_s=floats,
    num_tokens=ints,
    num_padding_tokens=ints,
    prompt_logprobs=st.lists(
        st.builds(
            PromptLogprobs,
            seq_id=ints,
            token_logprobs=st.lists(floats, max_size=4),
            ranks=st.lists(ints, max_size=4),
            top_logprobs=st.lists(st.lists(st.tuples(ints, floats), max_size=3), max_size=4),
        ),
        max_size=3,
    ),
    pooled=st.lists(
        st.builds(PooledOutput, seq_id=ints, data=st.lists(floats, max_size=8)), max_size=3
    ),
)
prompt_logprobs = st.builds(
    PromptLogprobs,
    seq_id=ints,
    token_logprobs=st.lists(floats, max_size=4),
    ranks=st.lists(ints, max_size=4),
    top_logprobs=st.lists(st.lists(st.tuples(ints, floats), max_size=3), max_size=4),
)
engine_outputs = st.builds(
    EngineOutputs,
    outputs=st.lists(
        st.builds(
            EngineOutput,
            request_id=st.text(max_size=40),
            token_ids=st.lists(ints, max_size=8),
            logprobs=st.lists(
                st.tuples(floats, st.lists(st.tuples(ints, floats), max_size=3)), max_size=4
            ),
            prompt_logprobs=st.one_of(st.none(), prompt_logprobs),
            finish_reason=st.one_of(st.none(), st.sampled_from(FINISH_REASONS)),
            error=st.one_of(st.none(), st.text(max_size=40)),
            num_cached_tokens=st.one_of(st.none(), ints),
            pooled=st.one_of(st.none(), st.lists(floats, max_size=8)),
        ),
        max_size=6,
    ),
)


engine_requests = st.builds(
    EngineRequest,
    request_id=st.text(max_size=40),
    label=st.text(max_size=40),
    prompt_token_ids=st.lists(ints, max_size=16),
    params=params,
    priority=st.integers(-(2**31), 2**31 - 1),
    lora_name=st.one_of(st.none(), st.text(max_size=20)),
    tenant=st.text(max_size=40),
    slo_ttft_ms=st.one_of(st.none(), floats),
)

ALLOWED = {StepPlan, StepResult, EngineOutputs, EngineRequest, CodecError}


def outcome(data: bytes) -> type:
    """The decoded message's type, or CodecError; any other exception propagates."""
    try:
        return type(decode(data))
    except CodecError:
        return CodecError


@settings(max_examples=200, deadline=None)
@given(plans)
def test_step_plan_round_trips(plan):
    assert decode(encode(plan), StepPlan) == plan


@settings(max_examples=200, deadline=None)
@given(results)
def test_step_result_round_trips(result):
    assert decode(encode(result), StepResult) == result


@settings(max_examples=200, deadline=None)
@given(engine_outputs)
def test_engine_outputs_round_trip(outputs):
    assert decode(encode(outputs), EngineOutputs) == outputs


@settings(max_examples=200, deadline=None)
@given(engine_requests)
def test_engine_request_round_trips(request):
    assert decode(encode(request), EngineRequest) == request


def test_an_engine_request_with_a_tenant_that_is_not_a_string_is_refused():
    good = encode(EngineRequest("k", "l", [1], SamplingParams(), tenant="a"))
    raw = msgpack.unpackb(good)
    raw[-2] = 7  # the tenant
    with pytest.raises(CodecError, match="EngineRequest.tenant: expected str"):
        decode(msgpack.packb(raw), EngineRequest)


def test_an_engine_output_with_an_unknown_finish_reason_is_refused():
    data = msgpack.packb([3, VERSION, [["r", [1], [], None, "done", None, None, None]]])
    with pytest.raises(CodecError, match="finish reason"):
        decode(data, EngineOutputs)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_codec_error(data):
    assert outcome(data) in ALLOWED


@settings(max_examples=300, deadline=None)
@given(plans, st.data())
def test_mutated_and_truncated_messages_raise_only_codec_error(plan, data):
    raw = bytearray(encode(plan))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    for candidate in (bytes(raw), bytes(raw[:cut])):
        assert outcome(candidate) in ALLOWED


def test_a_hundred_thousand_fuzzed_inputs_never_escape_codec_error():
    rng = random.Random(0)
    seeds = [
        encode(
            StepPlan(
                1,
                [NewSequence(7, "r", 0, [1, 2], 2, SamplingParams())],
                [ScheduledSeq(0, 0, 2, [0], True, 0)],
            )
        ),
        encode(
            StepResult(
                1,
                [SampledToken(7, 5, -0.1, [(5, -0.1)])],
                [FinishedSeq(7, "eos", [0])],
                0.1,
                2,
                0,
            )
        ),
    ]
    seen = set()
    for i in range(100_000):
        if i % 4 == 0:
            data = rng.randbytes(rng.randint(0, 64))
        else:
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data[: rng.randint(0, len(data))])
        seen.add(outcome(data))
    assert seen <= ALLOWED and CodecError in seen


V = VERSION
_PARAMS = msgpack.unpackb(encode(StepPlan(1, [NewSequence(0, "r", 0, [1], 1, SamplingParams())])))[
    3
][0][5]


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb(msgpack.ExtType(1, b"x")),  # extension type
        msgpack.packb([1, V, 1.5]),  # wrong field type
        msgpack.packb([9, V]),  # unknown tag
        msgpack.packb([1, 1, 1, [], [], [], []]),  # version 1: a plan without ``ahead``
        msgpack.packb([1, 2, 1, [["r", 0, [1], 1, []]], [], [], [], False]),  # version 2
        msgpack.packb([2, 3, 1, [], [], 0.0, 0, 0]),  # version 3: no prompt logprobs
        msgpack.packb([1, V + 1, 1, [], [], [], [], False]),  # unknown version
        msgpack.packb([1, V, True, [], [], [], [], False]),  # bool where int belongs
        msgpack.packb([1, V, 1, [], [], [], [], 0]),  # int where bool belongs
        msgpack.packb({"a": 1}),  # a map
        msgpack.packb([1, V, 1, [], [], [], [], False, "extra"]),  # extra field
        msgpack.packb([1, V, 1, [], [[0, 0, 1, [], True]], [], [], False]),  # short nested record
        msgpack.packb([2, V, 1, [["r", 5, None, []]], [], 0.0, 0, 0, []]),  # a str seq_id
        msgpack.packb([2, V, 1, [], [], 0.0, 0, 0, [[0, [-0.5], [1]]]]),  # short prompt logprobs
        msgpack.packb([2, V, 1, [], [], 0.0, 0, 0, [[0, [0], [1], [[]]]]]),  # an int logprob
        # version 4: a new sequence without ``num_cached_tokens``
        msgpack.packb([1, 4, 1, [[0, "r", 0, [1], 1, _PARAMS]], [], [], [], False]),
        # a new sequence whose cached tokens are not an int
        msgpack.packb([1, V, 1, [[0, "r", 0, [1], 1, _PARAMS, None]], [], [], [], False]),
        b"\xc1",  # reserved byte
        b"\x91" * 5000,  # deep nesting
    ],
)
def test_malformed_messages_are_refused(payload):
    with pytest.raises(CodecError):
        decode(payload)


def test_invalid_sampling_params_inside_a_plan_are_refused():
    plan = encode(StepPlan(1, [NewSequence(7, "r", 0, [1], 1, SamplingParams())]))
    raw = msgpack.unpackb(plan)
    raw[3][0][5][0] = 9.0  # temperature out of range
    with pytest.raises(CodecError, match="temperature"):
        decode(msgpack.packb(raw))


def test_expected_type_is_enforced_and_non_bytes_refused():
    with pytest.raises(CodecError, match="expected StepPlan"):
        decode(encode(StepResult(1)), StepPlan)
    with pytest.raises(CodecError, match="expected bytes"):
        decode("text")  # type: ignore[arg-type]
