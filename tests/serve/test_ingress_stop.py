"""A stopping ingress loses no connection: the ones the kernel queued on its
listener and nobody accepted yet, which a plain close would reset, are served,
and one accepted last still has time to send its request
(cluster/serve/ingress.py's ``stop_accepting``), with a real uvicorn server."""

from __future__ import annotations

import asyncio
import socket
import threading

import uvicorn

from iterserve.cluster.serve.ingress import stop_accepting
from tests.serve.conftest import _free_port

REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"


async def _ok(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _response(client: socket.socket) -> bytes:
    client.settimeout(10)
    chunks = []
    try:
        while chunk := client.recv(4096):
            chunks.append(chunk)
    except OSError as exc:  # a reset: what a plain close of the listener does
        return repr(exc).encode()
    finally:
        client.close()
    return b"".join(chunks)


async def test_connections_queued_on_a_stopping_listener_are_served():
    port = _free_port()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    listener.setblocking(False)
    server = uvicorn.Server(uvicorn.Config(_ok, lifespan="off", log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        await asyncio.sleep(0.01)
    # Connected while the event loop does not run: queued on the listener, not accepted.
    queued = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
    for client in queued[:3]:
        client.sendall(REQUEST)
    late = threading.Timer(0.3, queued[3].sendall, (REQUEST,))  # its request comes later
    late.start()
    await stop_accepting(server, listener, grace_s=1.0)
    server.should_exit = True
    await serving
    late.join()
    responses = await asyncio.gather(*(asyncio.to_thread(_response, c) for c in queued))
    assert all(r.startswith(b"HTTP/1.1 200") for r in responses), responses
    assert listener.fileno() == -1  # closed: the port's other listeners take what comes next
