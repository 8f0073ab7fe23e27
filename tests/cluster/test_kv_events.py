"""KV events: a subscriber written from vLLM's documented event schema (its
``KVEventBatch`` of array-like, tagged msgspec structs) follows an engine's ZMQ
stream, asks the replay socket for what it missed, and rebuilds exactly the set
of blocks the engine's tiers hold after a fuzzed workload."""

from __future__ import annotations

import asyncio
import random
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.cluster.config import EngineConfig
from iterserve.cluster.engine.kv_events import check_kv_events_config, offset_endpoint
from iterserve.scheduler import FakeModel
from tests.cluster.inproc import engine_in_process


# -- vLLM's documented schema ----------------------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    """Follows one publisher; on a gap (or at its start) replays what it missed.

    The replay answer is one message per batch kept and an end marker, so the
    replay socket is a DEALER: a REQ socket takes one reply per request, and the
    rest of an answer would come back as the reply to its next request."""

    def __init__(self, endpoint: str, replay: str, topic: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.last_seq = -1
        self.blocks: set[tuple[str, bytes]] = set()
        self.num_replayed = 0

    def _apply(self, payload: bytes) -> None:
        for event in self.decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                self.blocks |= {(event.medium, h) for h in event.block_hashes}
            elif isinstance(event, BlockRemoved):
                self.blocks -= {(event.medium, h) for h in event.block_hashes}
            else:
                self.blocks.clear()

    def _replay_from(self, first: int, until: int | None) -> None:
        self.replay.send_multipart((b"", first.to_bytes(8, "big")))
        while self.replay.poll(2000):
            _, seq_bytes, payload = self.replay.recv_multipart()
            if not payload:
                break
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last_seq and (until is None or seq < until):
                self._apply(payload)
                self.last_seq = seq
                self.num_replayed += 1

    def catch_up(self) -> None:
        """Asks the replay socket for everything after the last batch seen (what a
        subscriber does when it heard nothing yet, or suspects it missed the tail)."""
        self._replay_from(self.last_seq + 1, None)

    async def follow(self, truth, timeout_s: float = 30.0) -> None:
        """Polls, catching up when behind, until its blocks are ``truth()`` or the
        time is up: on a loaded machine the publisher's thread and the subscription
        itself can take longer than any fixed wait."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll(100)
            if self.blocks == truth():
                return
            self.catch_up()
            await asyncio.sleep(0.1)

    def poll(self, timeout_ms: int = 50) -> None:
        while self.sub.poll(timeout_ms):
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last_seq + 1:
                self._replay_from(self.last_seq + 1, seq)
            if seq > self.last_seq:
                self._apply(payload)
                self.last_seq = seq

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def test_the_config_takes_vllms_keys_and_refuses_others_by_name():
    config = check_kv_events_config({"enable_kv_cache_events": True})
    assert config["publisher"] == "zmq" and config["endpoint"] == "tcp://*:5557"
    with pytest.raises(ValueError, match="kv_events_config: unknown keys bogus"):
        EngineConfig.from_dict({"kv_events_config": {"bogus": 1}})
    with pytest.raises(ValueError, match="kv_events_config.topic"):
        EngineConfig.from_dict({"kv_events_config": {"topic": 3}})
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"


PROMPTS = [[3 + (7 * i + j) % 50 for j in range(40)] for i in range(4)]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    picks=st.lists(
        st.tuples(st.integers(0, 3), st.integers(4, 39), st.integers(1, 6)), min_size=1, max_size=12
    ),  # fmt: skip
    seed=st.integers(0, 1000),
)
def test_a_subscriber_rebuilds_the_engines_cached_blocks_from_the_events(picks, seed):
    disk: dict = {}
    model = FakeModel(vocab_size=64, max_model_len=64, kv_block_bytes=1 << 20, kv_disk=disk)
    config = dict(
        num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
        kv_offloading_size=16 / 1024,  # 16 host blocks of 1 MiB
        kv_disk_cache_dir="unused-by-the-fake", kv_disk_cache_size=24 / 1024,
        kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                          "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"},
    )  # fmt: skip

    async def scenario():
        async with engine_in_process(model, **config) as (core, client):
            endpoints = (await core.stats())["kv_events"]
            sub = Subscriber(endpoints["endpoint"], endpoints["replay_endpoint"], "kv")
            rng = random.Random(seed)
            streams = []
            for which, length, max_tokens in picks:
                prompt = PROMPTS[which][:length]
                stream = await client.open("r", prompt, {"max_tokens": max_tokens}, 0)
                if rng.random() < 0.2:
                    stream.abort()
                streams.append(stream)
                await asyncio.sleep(0)
            for stream in streams:
                async for _ in stream:
                    pass
            while core.scheduler.has_work or core.scheduler.num_in_flight:
                await asyncio.sleep(0.01)
            await sub.follow(core.scheduler.tiers.cached_set)
            # One connects once everything was published (the first has it all): it
            # can learn it only by replay.
            late = Subscriber(endpoints["endpoint"], endpoints["replay_endpoint"], "kv")
            for each in (late, sub):
                await each.follow(core.scheduler.tiers.cached_set)
            expected = core.scheduler.tiers.cached_set()
            assert sub.blocks == late.blocks == expected and expected
            assert late.num_replayed > 0
            assert {medium for medium, _ in expected} >= {"GPU", "CPU"}
            assert await core.reset_prefix_cache(reset_external=True)
            for each in (sub, late):
                await each.follow(core.scheduler.tiers.cached_set)
                assert each.blocks == core.scheduler.tiers.cached_set() == set()
                each.close()

    asyncio.run(scenario())
