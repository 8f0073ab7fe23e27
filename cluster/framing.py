"""Frames and the handshake of the cluster's two socket channels.

The step channel (scheduler -> ranks, :mod:`~iterserve.cluster.ranks.step_channel`) and the engine
channel (ingress -> engine, :mod:`~iterserve.cluster.engine.channel`) are both stream sockets: a
Unix socket in a private directory for a peer on the same node, TCP beyond it.
Both speak in frames, and both admit a peer only with a one-off token that the
listener handed it through Ray; this module is the one place that does either.

A frame is a 4-byte big-endian length, then that many bytes of payload; each
channel bounds the payload (a longer one closes the connection)::

    [len:4][payload: len bytes]

The handshake is the connecting side's first frame: the listener's token, then
the peer's name in UTF-8. A connection whose first frame is anything else, or
that sends none within ``HELLO_TIMEOUT_S``, is closed unanswered.

An address is ``("unix", path)`` or ``("tcp", host, port)``. The asyncio helpers
serve the scheduler and both ends of the engine channel; the blocking ones
serve a rank, which waits for plans on a thread of its own.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
import shutil
import socket
import struct
import tempfile

HEADER = struct.Struct("!I")
TOKEN_BYTES = 32
HELLO_TIMEOUT_S = 10.0
MAX_NAME_BYTES = 256


class ChannelClosed(ConnectionError):
    """The other end of a channel went away, or broke its protocol."""


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def hello(token: bytes, name: str) -> bytes:
    """The handshake frame a connecting peer sends first."""
    return frame(token + name.encode()[:MAX_NAME_BYTES])


def _peer_name(payload: bytes, token: bytes) -> str:
    if len(payload) < len(token) or not hmac.compare_digest(payload[: len(token)], token):
        raise ChannelClosed("a connection without the token")
    return payload[len(token) :].decode(errors="replace")


def set_nodelay(sock: socket.socket | None) -> None:
    """Small frames leave at once on TCP (one per step: nothing to coalesce)."""
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class PrivateDir:
    """A directory only this user can enter (mode 0700), for Unix sockets."""

    def __init__(self, prefix: str):
        self.path = tempfile.mkdtemp(prefix=prefix)

    def socket_path(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# -- asyncio ---------------------------------------------------------------------------


async def read_frame(reader: asyncio.StreamReader, max_bytes: int, what: str) -> bytes:
    """The next frame's payload; ``ChannelClosed`` (naming ``what``) when the
    connection ends or the frame is empty or over ``max_bytes``."""
    try:
        (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if not 0 < length <= max_bytes:
            raise ChannelClosed(f"{what} sent a frame of {length} bytes (at most {max_bytes})")
        return await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        raise ChannelClosed(f"{what} closed its channel") from None


async def read_hello(reader: asyncio.StreamReader, token: bytes) -> str:
    """The name of a connecting peer that presents ``token``; raises ChannelClosed."""
    try:
        payload = await asyncio.wait_for(
            read_frame(reader, TOKEN_BYTES + MAX_NAME_BYTES, "a connecting peer"), HELLO_TIMEOUT_S
        )
    except asyncio.TimeoutError:
        raise ChannelClosed("a connection that never said hello") from None
    return _peer_name(payload, token)


async def connect(
    address: tuple, token: bytes, name: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Opens a stream to ``address`` and says hello."""
    if address[0] == "unix":
        reader, writer = await asyncio.open_unix_connection(address[1])
    else:
        reader, writer = await asyncio.open_connection(address[1], address[2])
        set_nodelay(writer.get_extra_info("socket"))
    writer.write(hello(token, name))
    return reader, writer


# -- blocking (a rank's thread) -------------------------------------------------------------


def recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ChannelClosed("the channel was closed")
        got += k
    return bytes(buf)


def recv_frame(conn: socket.socket, max_bytes: int) -> bytes:
    (length,) = HEADER.unpack(recv_exact(conn, HEADER.size))
    if length > max_bytes:
        raise ChannelClosed(f"a frame of {length} bytes is over the {max_bytes} limit")
    return recv_exact(conn, length)


def accept_hello(conn: socket.socket, token: bytes) -> str:
    """The name of the peer on ``conn`` if it presents ``token`` within the hello
    timeout; raises ChannelClosed (or OSError) otherwise."""
    conn.settimeout(HELLO_TIMEOUT_S)
    name = _peer_name(recv_frame(conn, TOKEN_BYTES + MAX_NAME_BYTES), token)
    conn.settimeout(None)
    return name
