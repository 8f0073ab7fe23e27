"""Helpers shared by the reliability tests: engine state snapshots, the server's
processes, and raw HTTP for requests that well-behaved clients refuse to send.

The server fixtures (``serve_url``, ``tokenizer_dir``, ``tiny_model_dir``, ...)
come from ``tests/conftest.py``; the app helpers from ``tests/serve/conftest.py``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import psutil


def engine_marks(stats: dict) -> dict[str, tuple]:
    """Per replica, what a request that reaches the scheduler changes: the
    iteration clock and the counters (admitted tokens, finishes, refusals)."""
    return {
        r["replica"]: (r.get("step"), tuple(sorted(r.get("counters", {}).items())))
        for r in stats["replicas"]
    }


def replica_pids(app: str, deployment: str) -> list[int]:
    """Pids of a deployment's Serve replicas in ``app``. Ray's processes are this
    test session's children; each replica's process title names its app and class."""
    title = f"ray::ServeReplica:{app}:{deployment}"
    pids = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:  # it ended while we looked
            continue
        if cmdline.startswith(title):
            pids.append(proc.pid)
    return pids


def rss_bytes(pids: list[int]) -> int:
    return sum(psutil.Process(pid).memory_info().rss for pid in pids)


async def wait_for(predicate, timeout_s: float, interval_s: float = 0.1):
    """Polls an async predicate until it returns something truthy; that value, or
    None once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(interval_s)
    return None


async def idle_replicas(client: httpx.AsyncClient, timeout_s: float = 30.0) -> list[dict]:
    """Every replica's stats once none holds a slot, a KV block or a waiting request
    (an abort frees them at the next step); the last stats seen otherwise."""
    last: list[dict] = []

    async def idle():
        nonlocal last
        last = (await client.get("/v1/stats")).json()["replicas"]
        keys = ("slots_used", "kv_blocks_used", "num_running", "num_waiting")
        return all(r.get(key, 0) == 0 for r in last for key in keys)

    await wait_for(idle, timeout_s, 0.05)
    return last


class RawResponse:
    def __init__(self, data: bytes):
        head, _, self.body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1]) if lines and lines[0] else 0
        self.headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        if self.headers.get("transfer-encoding") == "chunked":
            self.body = _unchunk(self.body)

    def json(self) -> dict:
        return json.loads(self.body)


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        length = int(size.split(b";")[0] or b"0", 16)
        if length == 0:
            break
        out, data = out + rest[:length], rest[length + 2 :]
    return out


def raw_request(
    base_url: str, head: bytes, body: bytes = b"", timeout_s: float = 30
) -> RawResponse:
    """Sends bytes as they are (no client-side checks or normalisation): ``head`` is
    the request line and headers without the blank line; ``{prefix}`` in it is the
    app's route prefix. Reads until the server closes the connection."""
    url = urlsplit(base_url)
    head = head.replace(b"{prefix}", url.path.encode())
    head += b"\r\nHost: 127.0.0.1\r\nConnection: close"
    if body and b"content-length:" not in head.lower():
        head += b"\r\nContent-Length: " + str(len(body)).encode()
    data = b""
    with socket.create_connection((url.hostname, url.port), timeout=timeout_s) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        while chunk := sock.recv(1 << 16):
            data += chunk
    return RawResponse(data)
