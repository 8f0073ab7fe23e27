"""The engine channel: one stream socket between an ingress and an engine replica.

Requests go in and tokens come out on it, not through Ray: Ray's per-item
streaming between Serve actors cost more CPU per token than the model's
forward on a CPU. An engine replica listens on a Unix socket (for ingresses on
its node) and on TCP (for the others); an ingress connects with the token the
replica handed out through Serve (``EngineServer.endpoint``) and its own id
(frames and the handshake: :mod:`framing`). Then, on each connection::

    ingress -> engine   [ADD, key, label, prompt_token_ids, params, priority]
                        [ABORT, key]
    engine -> ingress   [ACCEPTED, key] | [REFUSED, key, kind, message]
                        [OUTPUTS, [[key, token_ids, logprobs, finish_reason, error], ...]]

``OUTPUTS`` carries everything one step produced for that ingress's requests,
in one frame: the per-token cost is a few list entries, not a message. The
``key`` names a request on its connection (the ingress makes it unique); the
``label`` is the client's own request id, for logs. A frame's payload is a
msgpack array of plain types (no extension types).
A connection that closes aborts every request it added.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgpack

from iterserve.cluster.framing import (
    HEADER,
    ChannelClosed,
    PrivateDir,
    connect,
    frame,
    new_token,
    read_frame,
    read_hello,
    set_nodelay,
)
from iterserve.cluster.outputs import Record

logger = logging.getLogger(__name__)

ADD, ABORT, ACCEPTED, REFUSED, OUTPUTS = range(1, 6)
MAX_FRAME_BYTES = 64 << 20
OUTPUTS_OVERHEAD = 16  # an OUTPUTS frame's bytes besides its records' (kind, array headers)
# An ingress that stops reading its outputs must not grow the engine without bound.
MAX_UNSENT_BYTES = 256 << 20


def encode(message: list) -> bytes:
    return frame(msgpack.packb(message, use_bin_type=True))


def _no_ext(code, data):
    raise ValueError("msgpack extension types are not accepted")


async def read_message(reader: asyncio.StreamReader, what: str) -> list:
    payload = await read_frame(reader, MAX_FRAME_BYTES, what)
    try:
        message = msgpack.unpackb(payload, raw=False, ext_hook=_no_ext, strict_map_key=True)
    except Exception as exc:
        raise ChannelClosed(f"not a message: {type(exc).__name__}: {exc}") from None
    if type(message) is not list or not message or type(message[0]) is not int:
        raise ChannelClosed("a message is an array [kind, ...]")
    return message


# -- the engine's end ----------------------------------------------------------------


class EngineEndpoint:
    """An engine replica's end of every ingress's channel. ``core`` is its
    ``EngineCore``; each connection is one of the core's consumers, whose
    outputs the core hands to :meth:`_send` once per step."""

    def __init__(self, core: Any, host: str):
        self.core = core
        self.host = host
        self.token = new_token()
        self.dir = PrivateDir("iterserve-engine-")
        self.servers: list[asyncio.AbstractServer] = []
        self.writers: set[asyncio.StreamWriter] = set()  # every open connection
        self.address: dict = {}
        self.next_consumer = 0

    async def start(self) -> dict:
        path = self.dir.socket_path("engine.sock")
        self.servers.append(await asyncio.start_unix_server(self._serve, path=path))
        tcp = await asyncio.start_server(self._serve, host=self.host, port=0)
        self.servers.append(tcp)
        port = tcp.sockets[0].getsockname()[1]
        self.address = {"unix": path, "tcp": [self.host, port], "token": self.token.hex()}
        return self.address

    def close(self) -> None:
        """Stops listening and closes every connection: their ingresses end the
        requests on them with an error."""
        for server in self.servers:
            server.close()
        for writer in list(self.writers):
            writer.close()
        self.dir.remove()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        set_nodelay(writer.get_extra_info("socket"))
        try:
            name = await read_hello(reader, self.token)
        except ChannelClosed as exc:
            logger.warning("engine channel refused: %s", exc)
            writer.close()
            return
        self.next_consumer += 1
        consumer = f"{name}#{self.next_consumer}"
        self.writers.add(writer)
        outputs = self.core.outputs
        outputs.attach(consumer, lambda records: self._send(writer, records))
        try:
            while True:
                await self._handle(consumer, writer, await read_message(reader, consumer))
        except ChannelClosed:
            pass
        except Exception:
            logger.exception("engine channel %s failed", consumer)
        finally:
            self.writers.discard(writer)
            for key in outputs.detach(consumer):
                await self.core.abort(key)  # nobody reads them any more
            writer.close()

    async def _handle(self, consumer: str, writer: asyncio.StreamWriter, message: list) -> None:
        kind = message[0]
        if kind == ADD and len(message) == 6:
            _, key, label, prompt, params, priority = message
            if not isinstance(key, str) or not isinstance(params, dict):
                raise ChannelClosed("a malformed ADD")
            refusal = await self.core.add_request(consumer, key, prompt, params, priority, label)
            reply = [ACCEPTED, key] if refusal is None else [REFUSED, key, *refusal]
            writer.write(encode(reply))
        elif kind == ABORT and len(message) == 2:
            await self.core.abort(message[1])
        else:
            raise ChannelClosed(f"an unknown message kind {kind!r}")

    def _send(self, writer: asyncio.StreamWriter, records: list[Record]) -> None:
        if writer.is_closing():
            return
        for data in self._output_frames(records):
            writer.write(data)
        if writer.transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            # Dropped at once: close() would wait to flush what the ingress does not
            # read, and read nothing more meanwhile, so its requests would run on
            # unread and its next ones never be answered. Dropping it ends the read
            # loop, which aborts every request on the channel.
            logger.error("an ingress stopped reading its outputs: dropping its channel")
            writer.transport.abort()

    def _output_frames(self, records: list[Record]) -> list[bytes]:
        """``OUTPUTS`` frames for one step's records, each within the frame bound the
        reader enforces (one frame, unless a step's outputs are larger). A record
        larger than a frame on its own fails its request alone."""
        whole = encode([OUTPUTS, records])
        if len(whole) - HEADER.size <= MAX_FRAME_BYTES:
            return [whole]
        frames: list[bytes] = []
        chunk: list[Record] = []
        size = 0
        for record in records:
            n = len(msgpack.packb(record, use_bin_type=True))
            if n + OUTPUTS_OVERHEAD > MAX_FRAME_BYTES:
                logger.error("%s: one step's outputs exceed a frame; failing it", record[0])
                message = (
                    f"one step's outputs exceed the engine channel's frame of "
                    f"{MAX_FRAME_BYTES} bytes"
                )
                record = (record[0], [], [], "error", message, None)
                n = len(msgpack.packb(record, use_bin_type=True))
                asyncio.get_running_loop().create_task(self.core.abort(record[0]))
            if chunk and size + n + OUTPUTS_OVERHEAD > MAX_FRAME_BYTES:
                frames.append(encode([OUTPUTS, chunk]))
                chunk, size = [], 0
            chunk.append(record)
            size += n
        frames.append(encode([OUTPUTS, chunk]))
        return frames


# -- the ingress's end ---------------------------------------------------------------


class RequestStream:
    """One request's outputs on an ingress: batches of ``(token_ids, logprobs,
    finish_reason, error)`` records, everything that arrived since the last
    batch. ``cancel`` aborts the request (when it has not finished)."""

    def __init__(self, connection: EngineConnection, key: str):
        self.connection = connection
        self.key = key
        self.records: list[tuple] = []
        self.wake = asyncio.Event()
        self.done = False  # a finishing record arrived, or the stream was cancelled

    def feed(self, record: tuple) -> None:
        self.records.append(record)
        self.wake.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[tuple]:
        while not self.records:
            if self.done:
                raise StopAsyncIteration
            self.wake.clear()
            await self.wake.wait()
        batch, self.records = self.records, []
        if batch[-1][2] is not None:  # finished (or failed): nothing follows
            self.done = True
            self.connection.streams.pop(self.key, None)
        return batch

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.connection.streams.pop(self.key, None)
            self.connection.send([ABORT, self.key])
        self.wake.set()


class EngineConnection:
    """An ingress's connection to one engine replica: it adds requests, and a
    reader task hands each step's outputs to their requests' streams."""

    def __init__(self, replica: str, reader, writer, on_close: Callable[[EngineConnection], None]):
        self.replica = replica
        self.reader, self.writer = reader, writer
        self.streams: dict[str, RequestStream] = {}
        self.pending: dict[str, asyncio.Future] = {}  # ADDs waiting for their answer
        self.closed = False
        self.on_close = on_close
        self.task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(
        cls, endpoint: dict, ingress_id: str, local: bool, on_close
    ) -> EngineConnection:
        address = ("unix", endpoint["unix"]) if local else ("tcp", *endpoint["tcp"])
        token = bytes.fromhex(endpoint["token"])
        reader, writer = await connect(address, token, ingress_id)
        return cls(endpoint["replica"], reader, writer, on_close)

    @property
    def load(self) -> int:
        return len(self.streams) + len(self.pending)

    def send(self, message: list) -> None:
        if not self.closed:
            self.writer.write(encode(message))

    async def add(self, key, label, prompt, params, priority) -> RequestStream:
        """Queues a request on this replica; raises ``ChannelClosed`` if the replica
        is gone, or returns ``(kind, message)`` refusals as ``RefusedError``."""
        if self.closed:
            raise ChannelClosed(f"the channel to engine replica {self.replica} is closed")
        stream = self.streams[key] = RequestStream(self, key)
        answer = self.pending[key] = asyncio.get_running_loop().create_future()
        self.send([ADD, key, label, prompt, params, priority])
        try:
            refusal = await answer
        except BaseException:
            self.pending.pop(key, None)
            stream.cancel()  # a caller cancelled while waiting: abort if it was added
            raise
        if refusal is not None:
            self.streams.pop(key, None)
            raise RefusedError(*refusal)
        return stream

    async def _read(self) -> None:
        try:
            while True:
                message = await read_message(self.reader, f"engine replica {self.replica}")
                kind = message[0]
                if kind == OUTPUTS:
                    streams = self.streams
                    for key, *record in message[1]:
                        stream = streams.get(key)
                        if stream is not None:
                            stream.feed(record)
                elif kind in (ACCEPTED, REFUSED):
                    answer = self.pending.pop(message[1], None)
                    if answer is not None and not answer.done():
                        answer.set_result(None if kind == ACCEPTED else message[2:4])
        except ChannelClosed:
            pass
        except Exception:
            logger.exception("the channel to engine replica %s failed", self.replica)
        finally:
            self._fail(f"engine replica {self.replica} went away")

    def _fail(self, message: str) -> None:
        self.closed = True
        self.writer.close()
        for answer in self.pending.values():
            if not answer.done():
                answer.set_result(["unavailable", message])
        self.pending.clear()
        for stream in list(self.streams.values()):
            stream.feed(([], [], "error", message, None))
        self.streams.clear()
        self.on_close(self)

    def close(self) -> None:
        self.task.cancel()


class RefusedError(Exception):
    """The engine refused a request: ``kind`` as ``EngineCore.add_request`` says it."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message
