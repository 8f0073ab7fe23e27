"""The step-message decoder on hostile structures, each under a time bound.

``tests/scheduler/test_codec.py`` already feeds the decoder 100,000 random and
mutated inputs. These are the shapes a fuzzer rarely builds: lengths declared in
the gigabytes with no data behind them, nesting a hundred thousand deep, every
msgpack type byte in every position, over-long lists and strings, extension
types, truncations of a real message at every byte. Every one must be refused
with ``CodecError`` — never another exception, never a hang.
"""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest

from iterserve.scheduler import SamplingParams, codec
from iterserve.scheduler.codec import MAX_LIST_LEN, MAX_STR_LEN, CodecError
from iterserve.scheduler.messages import NewSequence, ScheduledSeq, StepPlan

TIME_BOUND_S = 10.0  # per input; a decoder that hangs fails here instead of blocking


def _plan_bytes() -> bytes:
    params = SamplingParams(temperature=0.7, seed=1, logprobs=2, stop_token_ids=(5, 6))
    plan = StepPlan(
        step=7,
        new_seqs=[NewSequence(0, "r0", 0, [1, 2, 3], 3, params)],
        scheduled=[ScheduledSeq(0, 0, 3, [0], True, 0)],
        released_slots=[1],
        padding_slots=[],
    )
    return codec.encode(plan)


PLAN = _plan_bytes()
# Type bytes whose length field follows them (str8/16/32, bin8/16/32, array16/32,
# map16/32, ext8/16/32), with the largest length each can declare.
HUGE_LENGTHS = {
    0xD9: b"\xff", 0xDA: b"\xff\xff", 0xDB: b"\xff\xff\xff\xff",
    0xC4: b"\xff", 0xC5: b"\xff\xff", 0xC6: b"\xff\xff\xff\xff",
    0xDC: b"\xff\xff", 0xDD: b"\xff\xff\xff\xff",
    0xDE: b"\xff\xff", 0xDF: b"\xff\xff\xff\xff",
    0xC7: b"\xff\x01", 0xC8: b"\xff\xff\x01", 0xC9: b"\xff\xff\xff\xff\x01",
}  # fmt: skip
MESSAGE_PREFIX = b"\x97\x01\x01"  # [tag=StepPlan, version=1, ... as a 7-element array


def hostile_inputs() -> dict[str, bytes]:
    cases: dict[str, bytes] = {}
    for byte in range(256):
        cases[f"byte-{byte:02x}"] = bytes([byte])
        cases[f"byte-{byte:02x}-junk"] = bytes([byte]) + b"\xff" * 16
        cases[f"in-message-{byte:02x}"] = MESSAGE_PREFIX + bytes([byte]) + b"\x00" * 8
    for byte, length in HUGE_LENGTHS.items():
        cases[f"declared-{byte:02x}"] = bytes([byte]) + length
        cases[f"declared-{byte:02x}-in-message"] = MESSAGE_PREFIX + bytes([byte]) + length
    cases["deep-arrays"] = b"\x91" * 100_000 + b"\xc0"
    cases["deep-maps"] = b"\x81\xa1k" * 50_000 + b"\xc0"
    cases["deep-in-message"] = MESSAGE_PREFIX + b"\x91" * 100_000 + b"\x00"
    cases["list-too-long"] = (
        b"\xdd" + struct.pack(">I", MAX_LIST_LEN + 1) + b"\x00" * (MAX_LIST_LEN + 1)
    )
    cases["str-too-long"] = msgpack.packb("x" * (MAX_STR_LEN + 1))
    cases["bin"] = msgpack.packb([1, 1, b"\x00" * 8], use_bin_type=True)
    cases["map-message"] = msgpack.packb({"tag": 1, "version": 1})
    cases["ext-type"] = msgpack.packb([1, 1, msgpack.ExtType(1, b"x")])
    cases["timestamp"] = b"\xd6\xff" + b"\x00" * 4
    cases["uint64-step"] = msgpack.packb([1, 1, 2**64 - 1, [], [], [], []])
    cases["float-step"] = msgpack.packb([1, 1, 7.0, [], [], [], []])
    cases["nan-temperature"] = PLAN.replace(msgpack.packb(0.7), msgpack.packb(float("nan")))
    cases["unknown-tag"] = msgpack.packb([99, 1])
    cases["future-version"] = msgpack.packb([1, 2, 7, [], [], [], []])
    cases["bool-as-tag"] = msgpack.packb([True, 1])
    cases["missing-fields"] = msgpack.packb([1, 1, 7])
    cases["extra-fields"] = msgpack.packb([1, 1, 7, [], [], [], [], []])
    for cut in range(len(PLAN)):
        cases[f"truncated-at-{cut}"] = PLAN[:cut]
    cases["trailing-bytes"] = PLAN + b"\x00"
    return cases


CASES = hostile_inputs()


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor


def decode_bounded(pool: ThreadPoolExecutor, data: bytes):
    """Decodes in a rank thread; a decode still running after the bound fails the test."""
    return pool.submit(codec.decode, data).result(timeout=TIME_BOUND_S)


def test_a_real_plan_still_decodes(pool):
    assert isinstance(decode_bounded(pool, PLAN), StepPlan)


def test_every_hostile_input_is_refused_with_codec_error(pool):
    outcomes = {}
    for name, data in CASES.items():
        try:
            decoded = decode_bounded(pool, data)
        except CodecError:
            outcomes[name] = "refused"
        else:
            outcomes[name] = f"decoded to {type(decoded).__name__}"
    accepted = {name: how for name, how in outcomes.items() if how != "refused"}
    assert accepted == {}, accepted
    print(f"\n{len(outcomes)} hostile inputs, all refused with CodecError")
