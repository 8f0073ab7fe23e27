"""The step channel: one stream socket per rank, the scheduler's plan written once.

Each step the scheduler encodes the ``StepPlan`` once and writes the same frame
to every rank's socket; every rank answers one frame. A rank waits for its next
plan in a blocking ``recv`` on its own thread, and the scheduler waits for the
replies on its event loop: nobody spins, so an idle engine costs no CPU, and a
plan reaches a rank in tens of microseconds. Ranks on the scheduler's node are
reached over a Unix socket in a private directory; ranks on other nodes over
TCP. Either way a rank takes the first connection that presents the one-off
token the scheduler handed it through Ray, and drops any other (frames and the
handshake: :mod:`~iterserve.cluster.framing`).

A rank answers its frames in order, so the scheduler may write the next plan
before the previous reply has come (scheduling ahead): the rank finds it
waiting in its socket the moment it finishes a step.

A rank's reply payload starts with one status byte: ``OK`` then the encoded ``StepResult`` (or nothing),
or ``FAILED`` then the error's text.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable

from ..framing import (
    TOKEN_BYTES,
    ChannelClosed,
    PrivateDir,
    accept_hello,
    connect,
    frame,
    read_frame,
    recv_frame,
    set_nodelay,
)

__all__ = ["TOKEN_BYTES", "ChannelClosed", "RankEndpoint", "SchedulerChannel"]

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 30
OK, FAILED = b"\x00", b"\x01"
ACCEPT_TIMEOUT_S = 300.0  # a scheduler that never connects frees the listener


class RankEndpoint:
    """A rank's end: listens for the scheduler's one connection, then answers every
    frame with ``handler(frame)`` on a thread of its own, until the connection
    closes. ``handler`` exceptions are sent back as ``FAILED`` replies."""

    def __init__(self, handler: Callable[[bytes], bytes], token: bytes, local: bool, host: str):
        self.handler = handler
        self.token = token
        self.dir: PrivateDir | None = None
        if local:
            self.dir = PrivateDir("iterserve-step-")
            path = self.dir.socket_path("rank.sock")
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
                try:
                    accept_hello(conn, self.token)
                    return conn
                except (OSError, ChannelClosed):
                    conn.close()
        except OSError:  # accept timed out, or the listener was closed
            return None
        finally:
            self.listener.close()
            if self.dir is not None:
                self.dir.remove()

    def _run(self) -> None:
        conn = self._accept()
        if conn is None:
            return
        set_nodelay(conn)
        with conn:
            while True:
                try:
                    plan = recv_frame(conn, MAX_FRAME_BYTES)
                except (OSError, ChannelClosed):
                    return  # the scheduler closed the channel: this group is done
                try:
                    reply = OK + self.handler(plan)
                except Exception as exc:  # the step failed; the scheduler decides what next
                    logger.exception("step failed")
                    reply = FAILED + f"{type(exc).__name__}: {exc}".encode()[:4096]
                try:
                    conn.sendall(frame(reply))
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
                streams.append(await connect(address, token, "scheduler"))
        except BaseException:
            for _, writer in streams:
                writer.close()
            raise
        return cls(streams)

    async def send(self, payload: bytes) -> None:
        """Writes ``payload`` to every rank. A plan may be sent before the replies to
        the previous one have been read."""
        data = frame(payload)
        for _, writer in self.streams:
            writer.write(data)
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
        payload = await read_frame(reader, MAX_FRAME_BYTES, f"rank {rank}")
        if payload[:1] == FAILED:
            raise RuntimeError(f"rank {rank}: {payload[1:].decode(errors='replace')}")
        return payload[1:]

    def close(self) -> None:
        for _, writer in self.streams:
            writer.close()
        self.streams = []
