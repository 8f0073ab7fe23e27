"""The engine channel: one stream socket between an engine and each of its clients.

Every client reaches an engine this way: an ingress reaches each engine replica,
an in-process :class:`~iterserve.cluster.engine.api.AsyncEngine` the engine actor it
started. Requests go in and outputs come out on it, not through Ray: Ray's
per-item streaming between actors cost more CPU per token than the model's
forward on a CPU. An engine listens on a Unix socket (for clients on its node)
and on TCP (for the others); a client connects with the token the engine handed
out through Ray (frames and the handshake: :mod:`~iterserve.cluster.framing`). Then a frame's
payload is one kind byte and its body::

    client -> engine   ADD    EngineRequest (scheduler/codec.py)
                       ABORT  [key]
    engine -> client   ACCEPTED [key] | REFUSED [key, kind, message]
                       OUTPUTS  EngineOutputs (scheduler/codec.py)
                       NOTICE   [state, message]

``ADD`` and ``OUTPUTS`` are typed records encoded by the strict codec (a
request with its sampling parameters, tenant and first-token target; everything
one step produced for that client's requests: the per-token cost is a few list
entries, not a message); the other bodies are msgpack arrays of plain types.
The ``key`` (``EngineRequest.request_id``) is the engine's id of the request
(the client makes it unique); the ``label`` is the client's own name for it,
for logs. A step's outputs larger
than a frame go in several. ``NOTICE`` tells every client at once that the
engine stopped taking requests (``state``: ``draining`` while it finishes what
it has, ``dead`` once its ranks are gone for good), so that no client chooses
it again; it is sent to each connection once the state changes, and on connect. A connection that closes aborts every request it
added, and one whose client stops reading is dropped. This module is the
protocol and the engine's end; the client's end is :mod:`~iterserve.cluster.engine.connection`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgpack

from ...scheduler import codec
from ...scheduler.messages import EngineOutput, EngineOutputs, EngineRequest
from ..framing import (
    HEADER,
    ChannelClosed,
    PrivateDir,
    frame,
    new_token,
    read_frame,
    read_hello,
    set_nodelay,
)

logger = logging.getLogger(__name__)

ADD, ABORT, ACCEPTED, REFUSED, OUTPUTS, NOTICE = range(1, 7)
SERVING, DRAINING, DEAD = "serving", "draining", "dead"  # an engine's states, as NOTICE says
_OUTPUTS_KIND = bytes((OUTPUTS,))
MAX_FRAME_BYTES = 64 << 20
# A client that stops reading its outputs must not grow the engine without bound.
MAX_UNSENT_BYTES = 256 << 20


def encode(kind: int, body: list | EngineRequest) -> bytes:
    if isinstance(body, EngineRequest):
        return frame(bytes((kind,)) + codec.encode(body))
    return frame(bytes((kind,)) + msgpack.packb(body, use_bin_type=True))


def _no_ext(code, data):
    raise ValueError("msgpack extension types are not accepted")


async def read_message(reader: asyncio.StreamReader, what: str) -> tuple[int, Any]:
    """The next message: its kind and its body (a list, ``EngineOutputs`` or an
    ``EngineRequest``)."""
    payload = await read_frame(reader, MAX_FRAME_BYTES, what)
    kind, body = payload[0], payload[1:]
    try:
        if kind == OUTPUTS:
            return kind, codec.decode(body, EngineOutputs)
        if kind == ADD:
            return kind, codec.decode(body, EngineRequest)
        message = msgpack.unpackb(body, raw=False, ext_hook=_no_ext, strict_map_key=True)
    except Exception as exc:
        raise ChannelClosed(f"not a message: {type(exc).__name__}: {exc}") from None
    if type(message) is not list:
        raise ChannelClosed("a message's body is an array")
    return kind, message


def output_frames(outputs: list[EngineOutput]) -> tuple[list[bytes], list[EngineOutput]]:
    """``OUTPUTS`` frames for one step's outputs, each within the frame bound
    (one frame, unless a step's outputs are larger); and the outputs too large
    for a frame on their own, which are replaced by a failure of their request."""
    body = codec.encode(EngineOutputs(outputs))
    if len(body) < MAX_FRAME_BYTES:  # the kind byte is the payload's first
        return [b"".join((HEADER.pack(len(body) + 1), _OUTPUTS_KIND, body))], []
    if len(outputs) == 1:
        (output,) = outputs
        message = f"one step's outputs exceed the engine channel's frame of {MAX_FRAME_BYTES} bytes"
        return output_frames([EngineOutput.failed(output.request_id, message)])[0], [output]
    half = len(outputs) // 2
    first, too_large = output_frames(outputs[:half])
    second, more = output_frames(outputs[half:])
    return first + second, too_large + more


# -- the engine's end ----------------------------------------------------------------


class EngineEndpoint:
    """An engine's end of every client's channel. ``core`` is its ``EngineCore``;
    each connection is one of the core's clients, whose outputs the core hands to
    :meth:`_send` once per step."""

    def __init__(self, core: Any, host: str):
        self.core = core
        self.host = host
        self.token = new_token()
        self.dir = PrivateDir("iterserve-engine-")
        self.servers: list[asyncio.AbstractServer] = []
        self.writers: set[asyncio.StreamWriter] = set()  # every open connection
        self.address: dict = {}
        self.next_client = 0

    async def start(self) -> dict:
        path = self.dir.socket_path("engine.sock")
        self.servers.append(await asyncio.start_unix_server(self._serve, path=path))
        tcp = await asyncio.start_server(self._serve, host=self.host, port=0)
        self.servers.append(tcp)
        port = tcp.sockets[0].getsockname()[1]
        self.address = {"unix": path, "tcp": [self.host, port], "token": self.token.hex()}
        return self.address

    def notify(self, state: str, message: str) -> None:
        """Tells every client the engine's new state (``draining``, ``dead``)."""
        notice = encode(NOTICE, [state, message])
        for writer in list(self.writers):
            if not writer.is_closing():
                writer.write(notice)

    async def flush(self, timeout_s: float) -> None:
        """Waits (up to ``timeout_s``) until every client took what was written to it."""
        writers = [w for w in self.writers if not w.is_closing()]
        if writers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.gather(*(w.drain() for w in writers), return_exceptions=True),
                    timeout_s,
                )

    def close(self) -> None:
        """Stops listening and closes every connection: their clients end the
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
        self.next_client += 1
        client = f"{name}#{self.next_client}"
        self.writers.add(writer)
        state = self.core.state
        if state[0] != SERVING:  # a client connecting late learns it at once
            writer.write(encode(NOTICE, list(state)))
        outputs = self.core.outputs
        outputs.attach(client, lambda batch: self._send(writer, batch))
        try:
            while True:
                await self._handle(client, writer, *await read_message(reader, client))
        except (ChannelClosed, asyncio.CancelledError):  # gone, or the engine is stopping
            pass
        except Exception:
            logger.exception("engine channel %s failed", client)
        finally:
            self.writers.discard(writer)
            outputs.detach(client)
            for key in self.core.requests_of(client):
                await self.core.abort(key)  # nobody reads them any more
            writer.close()

    async def _handle(self, client: str, writer: asyncio.StreamWriter, kind: int, body) -> None:
        if kind == ADD:  # an EngineRequest, checked by the codec
            key = body.request_id
            found = await self.core.add_request(client, body)
            writer.write(
                encode(ACCEPTED, [key]) if found is None else encode(REFUSED, [key, *found])
            )
        elif kind == ABORT and len(body) == 1:
            await self.core.abort(body[0])
        else:
            raise ChannelClosed(f"an unknown message kind {kind!r}")

    def _send(self, writer: asyncio.StreamWriter, batch: list[EngineOutput]) -> None:
        if writer.is_closing():
            return
        frames, too_large = output_frames(batch)
        for data in frames:
            writer.write(data)
        for output in too_large:
            logger.error("%s: one step's outputs exceed a frame; failing it", output.request_id)
            asyncio.get_running_loop().create_task(self.core.abort(output.request_id))
        if writer.transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            # Dropped at once: close() would wait to flush what the client does not
            # read, and read nothing more meanwhile, so its requests would run on
            # unread and its next ones never be answered. Dropping it ends the read
            # loop, which aborts every request on the channel.
            logger.error("a client stopped reading its outputs: dropping its channel")
            writer.transport.abort()
