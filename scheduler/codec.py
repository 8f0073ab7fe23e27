"""The msgpack codec for the messages of :mod:`~iterserve.scheduler.messages`.

No pickle and no msgpack extension types: a message is a msgpack array
``[tag, version, field, ...]`` whose fields are ints, floats, bools, strings,
``None`` and nested arrays, in dataclass field order. Decoding checks every type
and every size against the message's schema and raises :class:`CodecError` —
never another exception — for malformed, truncated or oversized input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeAlias

import msgpack

from .messages import (
    FINISH_REASONS,
    AdapterLoad,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    FinishedSeq,
    KVReport,
    KVTransfers,
    NewSequence,
    PooledOutput,
    PromptLogprobs,
    SampledToken,
    ScheduledSeq,
    StepPlan,
    StepResult,
)
from .sampling import (
    MAX_GRAMMAR_BYTES,
    SamplingParams,
    SamplingParamsError,
    StructuredOutput,
)

# 2: StepPlan.ahead; 3: sequences named by seq_id; 4: the sampling extensions
# (logit bias, allowed tokens, bad words, prompt logprobs, structured outputs) and
# StepResult.prompt_logprobs; 5: NewSequence.num_cached_tokens; 6: EngineOutputs;
# 7: LoRA adapters (NewSequence.lora_slot, StepPlan.adapter_loads); 8: pooling
# (StepResult.pooled, EngineOutput.pooled), StructuredOutput.start_after; 9: KV tiers
# (StepPlan.kv, StepResult.kv); 10: EngineRequest
VERSION = 10
MAX_MESSAGE_BYTES = 256 << 20
MAX_LIST_LEN = 1 << 22
MAX_STR_LEN = MAX_GRAMMAR_BYTES  # the longest string is a grammar's spec
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1


class CodecError(ValueError):
    """Bytes that are not a valid message."""


# -- field kinds ---------------------------------------------------------------


def _int(v):
    if type(v) is not int or not INT_MIN <= v <= INT_MAX:
        raise CodecError(f"expected int, got {type(v).__name__}")
    return v


def _float(v):
    if type(v) is not float:
        raise CodecError(f"expected float, got {type(v).__name__}")
    return v


def _bool(v):
    if type(v) is not bool:
        raise CodecError(f"expected bool, got {type(v).__name__}")
    return v


def _str(v):
    if type(v) is not str:
        raise CodecError(f"expected str, got {type(v).__name__}")
    return v


def _optional(kind):
    return lambda v: None if v is None else kind(v)


def _list(kind):
    def decode(v):
        if type(v) is not list:
            raise CodecError(f"expected list, got {type(v).__name__}")
        return [kind(x) for x in v]

    return decode


def _pair(v):
    if type(v) is not list or len(v) != 2:
        raise CodecError("expected a [token_id, logprob] pair")
    return (_int(v[0]), _float(v[1]))


def _token_logprobs(v):
    if type(v) is not list or len(v) != 2:
        raise CodecError("expected a [logprob, top_logprobs] entry")
    return (_float(v[0]), _list(_pair)(v[1]))


def _finish_reason(v):
    if v not in FINISH_REASONS or type(v) is not str:
        raise CodecError(f"expected a finish reason, got {v!r}")
    return v


def _tuple_of_ints(v):
    return tuple(_list(_int)(v))


def _bias_pairs(v):
    return tuple(_list(_bias_pair)(v))


def _bias_pair(v):
    if type(v) is not list or len(v) != 2:
        raise CodecError("expected a [token_id, bias] pair")
    return (_int(v[0]), _float(v[1]))


def _token_sequences(v):
    return tuple(_list(_tuple_of_ints)(v))


def _record(cls):
    return lambda v: _decode_record(cls, v)


# Field decoders per class, in dataclass field order.
_SCHEMAS: dict[type, tuple] = {}
_SCHEMAS[SamplingParams] = (
    _float,
    _float,
    _int,
    _float,
    _float,
    _float,
    _float,
    _int,
    _int,
    _int,
    _optional(_int),
    _tuple_of_ints,
    _bool,
    _optional(_int),
    _bias_pairs,
    _optional(_tuple_of_ints),
    _token_sequences,
    _optional(_int),
    _optional(_record(StructuredOutput)),
)
_SCHEMAS[StructuredOutput] = (_str, _str, _optional(_int))
_SCHEMAS[NewSequence] = (
    _int,
    _str,
    _int,
    _list(_int),
    _int,
    _record(SamplingParams),
    _int,
    _int,
)
_SCHEMAS[AdapterLoad] = (_int, _int, _str, _str)
_SCHEMAS[ScheduledSeq] = (_int, _int, _int, _list(_int), _bool, _int, _list(_int), _int)
_SCHEMAS[KVTransfers] = (
    _list(_int),
    _list(_int),
    _list(_int),
    _list(_int),
    _bool,
    _list(_int),
    _list(_str),
    _list(_str),
    _list(_list(_int)),
    _list(_str),
    _list(_int),
    _list(_int),
    _list(_str),
)
_SCHEMAS[KVReport] = (
    _list(_int),
    _list(_int),
    _list(_str),
    _float,
    _list(_float),
    _list(_float),
)
_SCHEMAS[StepPlan] = (
    _int,
    _list(_record(NewSequence)),
    _list(_record(ScheduledSeq)),
    _list(_int),
    _list(_int),
    _bool,
    _list(_record(AdapterLoad)),
    _optional(_record(KVTransfers)),
)
_SCHEMAS[SampledToken] = (_int, _int, _optional(_float), _list(_pair))
_SCHEMAS[FinishedSeq] = (_int, _str, _list(_int))
_SCHEMAS[PromptLogprobs] = (_int, _list(_float), _list(_int), _list(_list(_pair)))
_SCHEMAS[PooledOutput] = (_int, _list(_float))
_SCHEMAS[StepResult] = (
    _int,
    _list(_record(SampledToken)),
    _list(_record(FinishedSeq)),
    _float,
    _int,
    _int,
    _list(_record(PromptLogprobs)),
    _list(_record(PooledOutput)),
    _optional(_record(KVReport)),
)
_SCHEMAS[EngineOutput] = (
    _str,
    _list(_int),
    _list(_token_logprobs),
    _optional(_record(PromptLogprobs)),
    _optional(_finish_reason),
    _optional(_str),
    _optional(_int),
    _optional(_list(_float)),
)
_SCHEMAS[EngineOutputs] = (_list(_record(EngineOutput)),)
_SCHEMAS[EngineRequest] = (
    _str,
    _str,
    _list(_int),
    _record(SamplingParams),
    _int,
    _optional(_str),
    _str,
    _optional(_float),
)
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _SCHEMAS}
for _cls, _schema in _SCHEMAS.items():
    assert len(_schema) == len(_FIELDS[_cls]), f"codec schema of {_cls.__name__} is stale"

_TAGS = {StepPlan: 1, StepResult: 2, EngineOutputs: 3, EngineRequest: 4}
_BY_TAG = {tag: cls for cls, tag in _TAGS.items()}


def _decode_record(cls, value):
    if type(value) is not list or len(value) != len(_SCHEMAS[cls]):
        raise CodecError(f"malformed {cls.__name__}")
    kwargs = {}
    for name, kind, item in zip(_FIELDS[cls], _SCHEMAS[cls], value, strict=True):
        try:
            kwargs[name] = kind(item)
        except CodecError as exc:
            raise CodecError(f"{cls.__name__}.{name}: {exc}") from None
    if cls in (SamplingParams, StructuredOutput):  # they validate themselves
        try:
            return cls(**kwargs)
        except SamplingParamsError as exc:
            raise CodecError(f"{cls.__name__}: {exc}") from None
    return cls(**kwargs)


def _encode_params(p: SamplingParams) -> list:
    return [
        p.temperature,
        p.top_p,
        p.top_k,
        p.min_p,
        p.presence_penalty,
        p.frequency_penalty,
        p.repetition_penalty,
        p.max_tokens,
        p.min_tokens,
        p.n,
        p.seed,
        list(p.stop_token_ids),
        p.ignore_eos,
        p.logprobs,
        [list(pair) for pair in p.logit_bias],
        None if p.allowed_token_ids is None else list(p.allowed_token_ids),
        [list(word) for word in p.bad_words],
        p.prompt_logprobs,
        None
        if p.structured_output is None
        else [
            p.structured_output.kind,
            p.structured_output.spec,
            p.structured_output.start_after,
        ],
    ]


# Hand-written encoders: the hot path of every step, so no reflection here. The
# schema assertion above and the round-trip tests keep them in step with the fields.
def _encode_plan(m: StepPlan) -> list:
    return [
        m.step,
        [
            [
                n.seq_id,
                n.label,
                n.slot_idx,
                n.token_ids,
                n.num_prompt_tokens,
                _encode_params(n.params),
                n.num_cached_tokens,
                n.lora_slot,
            ]
            for n in m.new_seqs
        ],
        [
            [
                s.slot_idx,
                s.start_pos,
                s.num_tokens,
                s.new_block_ids,
                s.sample,
                s.num_pad_tokens,
                s.draft_token_ids,
                s.num_draft_tokens,
            ]
            for s in m.scheduled
        ],
        m.released_slots,
        m.padding_slots,
        m.ahead,
        [[a.slot, a.adapter_id, a.name, a.path] for a in m.adapter_loads],
        None if m.kv is None else _encode_fields(m.kv),
    ]


def _encode_fields(m) -> list:
    """A record of plain fields (the KV tiers' messages: at most one per step)."""
    return [getattr(m, name) for name in _FIELDS[type(m)]]


def _encode_prompt_logprobs(p: PromptLogprobs) -> list:
    return [p.seq_id, p.token_logprobs, p.ranks, [[list(t) for t in top] for top in p.top_logprobs]]


def _encode_outputs(m: EngineOutputs) -> list:
    return [
        [
            [
                o.request_id,
                o.token_ids,
                [[lp, [list(p) for p in top]] for lp, top in o.logprobs] if o.logprobs else [],
                None if o.prompt_logprobs is None else _encode_prompt_logprobs(o.prompt_logprobs),
                o.finish_reason,
                o.error,
                o.num_cached_tokens,
                o.pooled,
            ]
            for o in m.outputs
        ]
    ]


def _encode_result(m: StepResult) -> list:
    return [
        m.step,
        [[t.seq_id, t.token_id, t.logprob, [list(p) for p in t.top_logprobs]] for t in m.sampled],
        [[f.seq_id, f.reason, f.block_ids] for f in m.finished],
        m.forward_s,
        m.num_tokens,
        m.num_padding_tokens,
        [_encode_prompt_logprobs(p) for p in m.prompt_logprobs],
        [[p.seq_id, p.data] for p in m.pooled],
        None if m.kv is None else _encode_fields(m.kv),
    ]


def _decode_outputs(value: list) -> EngineOutputs:
    """EngineOutputs with the same checks as the schema's, written out: a client
    decodes one per step with every stream's outputs, the hot path of its reads."""
    if len(value) != 1 or type(value[0]) is not list:
        raise CodecError("malformed EngineOutputs")
    outputs = []
    for v in value[0]:
        if type(v) is not list or len(v) != 8:
            raise CodecError("malformed EngineOutput")
        request_id, token_ids, logprobs, prompt, reason, error, cached, pooled = v
        if type(request_id) is not str:
            raise CodecError("EngineOutput.request_id: expected str")
        if type(token_ids) is not list:
            raise CodecError("EngineOutput.token_ids: expected list")
        for t in token_ids:
            if type(t) is not int:
                raise CodecError("EngineOutput.token_ids: expected int")
        if token_ids and not INT_MIN <= min(token_ids) <= max(token_ids) <= INT_MAX:
            raise CodecError("EngineOutput.token_ids: an int out of range")
        if logprobs:
            try:
                logprobs = _list(_token_logprobs)(logprobs)
            except CodecError as exc:
                raise CodecError(f"EngineOutput.logprobs: {exc}") from None
        elif type(logprobs) is not list:
            raise CodecError("EngineOutput.logprobs: expected list")
        if prompt is not None:
            prompt = _decode_record(PromptLogprobs, prompt)
        if reason is not None and (type(reason) is not str or reason not in FINISH_REASONS):
            raise CodecError(
                f"EngineOutput.finish_reason: expected a finish reason, got {reason!r}"
            )
        if error is not None and type(error) is not str:
            raise CodecError("EngineOutput.error: expected str")
        if cached is not None and type(cached) is not int:
            raise CodecError("EngineOutput.num_cached_tokens: expected int")
        if pooled is not None:  # once per pooling request: the schema's checks will do
            pooled = _SCHEMAS[EngineOutput][-1](pooled)
        outputs.append(
            EngineOutput(request_id, token_ids, logprobs, prompt, reason, error, cached, pooled)
        )
    return EngineOutputs(outputs)


def _encode_request(m: EngineRequest) -> list:
    return [
        m.request_id,
        m.label,
        m.prompt_token_ids,
        _encode_params(m.params),
        m.priority,
        m.lora_name,
        m.tenant,
        m.slo_ttft_ms,
    ]


_ENCODERS: dict[type, Callable[[Any], list]] = {
    StepPlan: _encode_plan,
    StepResult: _encode_result,
    EngineOutputs: _encode_outputs,
    EngineRequest: _encode_request,
}

Message: TypeAlias = "StepPlan | StepResult | EngineOutputs | EngineRequest"


# -- public API ----------------------------------------------------------------------


def encode(message: Message) -> bytes:
    tag = _TAGS.get(type(message))
    if tag is None:
        raise CodecError(f"cannot encode {type(message).__name__}")
    return msgpack.packb([tag, VERSION, *_ENCODERS[type(message)](message)], use_bin_type=True)


def _reject_ext(code, data):
    raise CodecError("msgpack extension types are not accepted")


def decode(data: bytes, expected: type | None = None) -> Message:
    """Decodes one message; ``expected`` (a message class) restricts its type."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise CodecError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_str_len=MAX_STR_LEN,
            max_bin_len=0,
            max_array_len=MAX_LIST_LEN,
            max_map_len=0,
            max_ext_len=0,
        )
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise CodecError(f"not a msgpack message: {type(exc).__name__}: {exc}") from None
    if type(raw) is not list or len(raw) < 2:
        raise CodecError("a message is an array [tag, version, ...]")
    tag, version = raw[0], raw[1]
    cls = _BY_TAG.get(tag) if type(tag) is int else None
    if cls is None:
        raise CodecError(f"unknown message tag {tag!r}")
    if version != VERSION or type(version) is not int:
        raise CodecError(f"unsupported message version {version!r}")
    if expected is not None and cls is not expected:
        raise CodecError(f"expected {expected.__name__}, got {cls.__name__}")
    try:
        if cls is EngineOutputs:
            return _decode_outputs(raw[2:])
        return _decode_record(cls, raw[2:])
    except CodecError:
        raise
    except Exception as exc:  # a schema check that slipped: still the codec's error
        raise CodecError(f"malformed {cls.__name__}: {exc}") from None
