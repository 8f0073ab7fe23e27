"""The step channel: one stream socket per rank, the scheduler's plan written once.

Each step the scheduler encodes the ``StepPlan`` once and writes the same frame
to every rank's socket; every rank answers one frame. A rank waits for its next
plan in a blocking ``recv`` on its own thread, and the scheduler waits for the
replies on its event loop: nobody spins, so an idle engine costs no CPU, and a
plan reaches a rank in tens of microseconds. Ranks on the scheduler's node are
reached over a Unix socket in a private directory; ranks on other nodes over
TCP, where the first bytes on a connection must be a one-off token the
scheduler handed the rank through Ray, and any other connection is dropped.

A rank answers its frames in order, so the scheduler may write the next plan
before the previous reply has come (scheduling ahead): the rank finds it
waiting in its socket the moment it finishes a step.

Frames: a 4-byte big-endian length, then the payload. A rank's reply payload
starts with one status byte: ``OK`` then the encoded ``StepResult`` (or nothing),
or ``FAILED`` then the error's text.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30
OK, FAILED = b"\x00", b"\x01"
TOKEN_BYTES = 32
ACCEPT_TIMEOUT_S = 300.0  # a scheduler that never connects frees the listener


class ChannelClosed(ConnectionError):
    """The other end of a step channel went away (a rank died, or was stopped)."""


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ChannelClosed("the step channel was closed")
        got += k
    return bytes(buf)


def _recv_frame(conn: socket.socket) -> bytes:
    (length,) = HEADER.unpack(_recv_exact(conn, HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise ChannelClosed(f"a frame of {length} bytes is over the {MAX_FRAME_BYTES} limit")
    return _recv_exact(conn, length)


def _frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


class RankEndpoint:
    """A rank's end: listens for the scheduler's one connection, then answers every
    frame with ``handler(frame)`` on a thread of its own, until the connection
    closes. ``handler`` exceptions are sent back as ``FAILED`` replies."""

    def __init__(self, handler: Callable[[bytes], bytes], token: bytes, local: bool, host: str):
        self.handler = handler
        self.token = token
        self.tmpdir: str | None = None
        if local:
            self.tmpdir = tempfile.mkdtemp(prefix="iterserve-step-")  # mode 0700
            path = os.path.join(self.tmpdir, "rank.sock")
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(path)
            self.address: tuple = ("unix", path)
        else:
            self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.listener.bind((host, 0))
            self.address = ("tcp", host, self.listener.getsockname()[1])
        self.listener.listen(4)
        self.listener.settimeout(ACCEPT_TIMEOUT_S)
        self.thread = threading.Thread(target=self._run, name="iterserve-steps", daemon=True)
        self.thread.start()

    def _accept(self) -> socket.socket | None:
        """The first connection that presents the token; others are closed unread."""
        try:
            while True:
                conn, _ = self.listener.accept()
                conn.settimeout(10.0)
                try:
                    if hmac.compare_digest(_recv_exact(conn, len(self.token)), self.token):
                        conn.settimeout(None)
                        return conn
                except (OSError, ChannelClosed):
                    pass
                conn.close()
        except OSError:  # accept timed out, or the listener was closed
            return None
        finally:
            self.listener.close()
            if self.tmpdir is not None:
                shutil.rmtree(self.tmpdir, ignore_errors=True)

    def _run(self) -> None:
        conn = self._accept()
        if conn is None:
            return
        if conn.family == socket.AF_INET:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                try:
                    frame = _recv_frame(conn)
                except (OSError, ChannelClosed):
                    return  # the scheduler closed the channel: this group is done
                try:
                    reply = OK + self.handler(frame)
                except Exception as exc:  # the step failed; the scheduler decides what next
                    logger.exception("step failed")
                    reply = FAILED + f"{type(exc).__name__}: {exc}".encode()[:4096]
                try:
                    conn.sendall(_frame(reply))
                except OSError:
                    return


class SchedulerChannel:
    """The scheduler's end: one connection per rank, on its event loop. It keeps
    no per-step state: a reply is the next frame on every rank's connection, and
    whoever sent the plans knows which step that is (the oldest not read)."""

    def __init__(self, streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]):
        self.streams = streams

    @classmethod
    async def connect(cls, addresses: list[tuple], token: bytes) -> SchedulerChannel:
        streams = []
        try:
            for address in addresses:
                if address[0] == "unix":
                    reader, writer = await asyncio.open_unix_connection(address[1])
                else:
                    reader, writer = await asyncio.open_connection(address[1], address[2])
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                streams.append((reader, writer))
                writer.write(token)
        except BaseException:
            for _, writer in streams:
                writer.close()
            raise
        return cls(streams)

    async def send(self, payload: bytes) -> None:
        """Writes ``payload`` to every rank. A plan may be sent before the replies to
        the previous one have been read."""
        frame = _frame(payload)
        for _, writer in self.streams:
            writer.write(frame)
        try:
            await asyncio.gather(*(writer.drain() for _, writer in self.streams))
        except (ConnectionError, OSError) as exc:
            raise ChannelClosed(f"a rank's step channel is closed: {exc}") from None

    async def recv(self) -> list[bytes]:
        """The next reply of every rank, in rank order. The first failure ends the
        wait (a dead rank must not wait behind a live one blocked in an all-reduce
        with it); the channel is then unusable, as the group it serves."""
        reads = [
            asyncio.ensure_future(self._reply(rank, reader))
            for rank, (reader, _) in enumerate(self.streams)
        ]
        try:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_EXCEPTION)
            for read in done:
                if read.exception() is not None:
                    raise read.exception()
            return [read.result() for read in reads]
        finally:
            for read in reads:
                read.cancel()

    @staticmethod
    async def _reply(rank: int, reader: asyncio.StreamReader) -> bytes:
        try:
            (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            if not 0 < length <= MAX_FRAME_BYTES:
                raise ChannelClosed(f"rank {rank} sent a frame of {length} bytes")
            payload = await reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            raise ChannelClosed(f"rank {rank} closed its step channel (it died)") from None
        if payload[:1] == FAILED:
            raise RuntimeError(f"rank {rank}: {payload[1:].decode(errors='replace')}")
        return payload[1:]

    def close(self) -> None:
        for _, writer in self.streams:
            writer.close()
        self.streams = []
