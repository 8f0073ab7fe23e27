"""A scripted HTTP/1.1 server on 127.0.0.1 for the client's tests.

Each request takes the next scripted reply (a function of the request
handler); the server records every request, and notices when a client closes
a stream it is still writing.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = Callable[["Handler"], None]


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle's
        # algorithm and delayed ACKs add ~40 ms to every reply.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        stub = self.server.stub
        headers = {k.lower(): v for k, v in self.headers.items()}
        stub.requests.append(Recorded(self.command, self.path, headers, json.loads(raw or "null")))
        reply = (
            stub.replies.popleft() if stub.replies else json_reply(500, {"detail": "unscripted"})
        )
        reply(self)

    do_GET = do_POST = do_DELETE = _handle

    def log_message(self, *args: Any) -> None:
        pass

    def start(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    stub: StubServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up (timeouts, closed streams) is expected here


class StubServer:
    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self.requests: list[Recorded] = []
        self.disconnected = threading.Event()
        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.stub = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.01,), daemon=True
        )
        self._thread.start()

    def add(self, *replies: Reply) -> StubServer:
        self.replies.extend(replies)
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def closed_port() -> int:
    """A port nothing listens on: connecting to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- replies ------------------------------------------------------------------------------


def json_reply(status: int, body: Any, headers: dict[str, str] | None = None) -> Reply:
    def reply(h: Handler) -> None:
        data = json.dumps(body).encode() if not isinstance(body, bytes) else body
        h.start(
            status,
            {
                "Content-Type": "application/json",
                "Content-Length": str(len(data)),
                **(headers or {}),
            },
        )
        h.wfile.write(data)

    return reply


def error_reply(
    status: int,
    message: str,
    *,
    request_id: str | None = None,
    retry_after: str | None = None,
    **detail: Any,
) -> Reply:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    body = {"error": {"message": message, "type": "x", "param": None, "code": None, **detail}}
    return json_reply(status, body, headers)


def slow_reply(delay_s: float, then: Reply) -> Reply:
    def reply(h: Handler) -> None:
        time.sleep(delay_s)
        then(h)

    return reply


def _event(payload: Any) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def _sse_start(h: Handler, request_id: str | None = None) -> None:
    headers = {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked"}
    if request_id:
        headers["X-Request-Id"] = request_id
    h.start(200, headers)


def sse_reply(events: list[Any], *, done: bool = True, request_id: str | None = None) -> Reply:
    """A complete stream: each event, then ``data: [DONE]`` unless ``done`` is false."""

    def reply(h: Handler) -> None:
        _sse_start(h, request_id)
        for payload in events:
            h.write_chunk(_event(payload))
        if done:
            h.write_chunk(_event("[DONE]"))
        h.write_chunk(b"")

    return reply


def raw_sse_reply(text: str) -> Reply:
    """A stream whose body is ``text`` exactly (for the framing details)."""

    def reply(h: Handler) -> None:
        _sse_start(h)
        h.write_chunk(text.encode())
        h.write_chunk(b"")

    return reply


def dropping_sse_reply(events: list[Any]) -> Reply:
    """Sends ``events``, then drops the connection in the middle of the body."""

    def reply(h: Handler) -> None:
        _sse_start(h)
        for payload in events:
            h.write_chunk(_event(payload))
        h.close_connection = True
        h.connection.shutdown(socket.SHUT_RDWR)

    return reply


def endless_sse_reply(event: Any, interval_s: float = 0.01, limit_s: float = 10.0) -> Reply:
    """Sends ``event`` every ``interval_s`` until the client goes away (then sets
    ``stub.disconnected``) or ``limit_s`` passes."""

    def reply(h: Handler) -> None:
        _sse_start(h)
        deadline = time.monotonic() + limit_s
        try:
            while time.monotonic() < deadline:
                h.write_chunk(_event(event))
                time.sleep(interval_s)
            h.write_chunk(_event("[DONE]"))
            h.write_chunk(b"")
        except OSError:  # broken pipe / reset: the client closed the stream
            h.close_connection = True
            h.server.stub.disconnected.set()

    return reply
