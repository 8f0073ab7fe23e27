"""KV cache events: each engine replica publishes its tiers' changes, as vLLM does.

With ``kv_events_config`` (vLLM's keys: ``enable_kv_cache_events``, ``publisher:
zmq``, ``endpoint``, ``replay_endpoint``, ``topic``, ``buffer_steps``, ``hwm``,
``max_queue_size``) a replica binds a ZMQ PUB socket and, with a replay
endpoint, a ROUTER socket; replica ``i`` binds each endpoint's port plus ``i``
(vLLM's rule for data-parallel ranks), a port ``*`` or ``0`` a free one, and
``/v1/stats`` lists what it bound. After each step with changes it sends one
multipart message ``[topic, seq (8 bytes, big-endian), payload]``; a subscriber
that sees a gap sends the first sequence number it missed (8 bytes) to the
replay socket and receives ``[seq, payload]`` for each batch it still keeps,
then ``[-1, b""]``: several messages to one request, so the subscriber's socket
is a DEALER (sending ``[b"", seq]``); a REQ socket takes only the first.

The payload is vLLM's documented msgpack format (its ``KVEventBatch``, with
array-like, tagged structs)::

    [ts, [event, ...], engine_index]
    ["BlockStored", [hash], parent_hash | None, [token_id, ...], block_size,
     None (lora_id), medium, lora_name | None]
    ["BlockRemoved", [hash, ...], medium]
    ["AllBlocksCleared"]

Hashes are the 16-byte block keys of :mod:`iterserve.scheduler.block_hash`
(BLAKE2b-128 chained over int64 token ids; ``iterserve_cache_config_info``
names it); events carry the token ids too, so a router can key blocks its own
way. Media: ``GPU`` (the device arena, vLLM's name whatever the device),
``CPU`` (the host tier), ``DISK``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgpack

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "enable_kv_cache_events": False,
    "publisher": None,
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
}
_TYPES = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str,
          "replay_endpoint": str, "buffer_steps": int, "hwm": int, "max_queue_size": int,
          "topic": str}  # fmt: skip
END_SEQ = (-1).to_bytes(8, "big", signed=True)
HASH_ALGO = "blake2b-128 chained over int64 token ids"


def check_kv_events_config(config: Any) -> dict[str, Any]:
    """The config with vLLM's defaults filled in (empty stays empty); a ValueError
    names a bad key."""
    if not isinstance(config, dict):
        raise ValueError("kv_events_config must be a mapping of vLLM's KVEventsConfig keys")
    if not config:
        return {}
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"kv_events_config: unknown keys {', '.join(unknown)}")
    out = {**DEFAULTS, **config}
    for key, value in config.items():
        kind = _TYPES[key]
        if value is None and key in ("publisher", "replay_endpoint"):
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"kv_events_config.{key} must be {kind.__name__}, got {value!r}")
        if kind is int and value <= 0:
            raise ValueError(f"kv_events_config.{key} must be > 0")
    if out["publisher"] is None:
        out["publisher"] = "zmq" if out["enable_kv_cache_events"] else "null"
    if out["publisher"] not in ("null", "zmq"):
        raise ValueError("kv_events_config.publisher must be zmq or null")
    for key in ("endpoint", "replay_endpoint"):
        if out[key] is not None and not out[key].startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events_config.{key} must be a zmq endpoint (tcp://host:port)")
    return out


def enabled(config: dict[str, Any]) -> bool:
    return bool(config) and config["enable_kv_cache_events"] and config["publisher"] == "zmq"


def offset_endpoint(endpoint: str, index: int) -> str:
    """Replica ``index``'s endpoint: the port plus the index (``*`` or 0: any free
    port); an ipc or inproc path gets a suffix."""
    if not endpoint.startswith("tcp://"):
        return endpoint if index == 0 else f"{endpoint}_dp{index}"
    host, _, port = endpoint.rpartition(":")
    if port in ("*", "0"):
        return f"{host}:*"
    return f"{host}:{int(port) + index}"


def encode_batch(events: list[tuple], block_size: int, engine_index: int, ts: float) -> bytes:
    """One ``KVEventBatch`` of the scheduler's event tuples; consecutive removals
    from one medium become one ``BlockRemoved``."""
    out: list[list] = []
    for event in events:
        kind = event[0]
        if kind == "stored":
            _, medium, key, parent, tokens, lora_name = event
            out.append(["BlockStored", [key], parent, list(tokens), block_size, None, medium,
                        lora_name])  # fmt: skip
        elif kind == "removed":
            last = out[-1] if out else None
            if last is not None and last[0] == "BlockRemoved" and last[2] == event[1]:
                last[1].append(event[2])
            else:
                out.append(["BlockRemoved", [event[2]], event[1]])
        else:
            out.append(["AllBlocksCleared"])
    return msgpack.packb([ts, out, engine_index], use_bin_type=True)


class KVEventPublisher:
    """A replica's PUB (and replay) sockets, served by a thread of their own: the
    engine's loop only queues encoded batches."""

    def __init__(self, config: dict[str, Any], engine_index: int, block_size: int):
        import zmq

        self.block_size = block_size
        self.engine_index = engine_index
        self.topic = config["topic"].encode()
        self._queue: queue.Queue = queue.Queue(config["max_queue_size"])
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config["buffer_steps"])
        self._seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config["hwm"])
        self.endpoint = self._attach(self._pub, offset_endpoint(config["endpoint"], engine_index))
        self._replay = None
        self.replay_endpoint = None
        if config["replay_endpoint"]:
            self._replay = self._ctx.socket(zmq.ROUTER)
            replay = offset_endpoint(config["replay_endpoint"], engine_index)
            self._replay.bind(replay)
            self.replay_endpoint = _bound(self._replay, replay)
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _attach(socket, endpoint: str) -> str:
        """Binds a wildcard, ipc or inproc endpoint; connects to any other (vLLM's
        rule: a named address is a collector's)."""
        if "*" in endpoint or "::" in endpoint or not endpoint.startswith("tcp://"):
            socket.bind(endpoint)
            return _bound(socket, endpoint)
        socket.connect(endpoint)
        return endpoint

    @property
    def endpoints(self) -> dict[str, str | None]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint}

    def publish(self, events: list[tuple]) -> None:
        """Queues one batch (dropped, with a log line, when the queue is full)."""
        if not events:
            return
        payload = encode_batch(events, self.block_size, self.engine_index, time.time())
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            logger.warning("KV events: the publisher's queue is full; a batch is dropped")

    def _serve(self) -> None:
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            seq = self._seq
            self._seq += 1
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: [identity, b"", start seq]
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2.0)


def _bound(socket, endpoint: str) -> str:
    import zmq

    last = socket.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if last else endpoint
