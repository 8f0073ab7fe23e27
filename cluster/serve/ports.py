"""One server per port: the ingress's listening socket, shared only within its app.

The ingress replicas of one app on one node share their HTTP port
(``SO_REUSEPORT``), so that a redeploy's new replicas listen beside the old
ones before those stop. The kernel lets any socket of the same user with that
option join the port, though, and then splits new connections among them: a
second server started on a port in use would silently take half the clients.
So each replica *claims* the port before it binds, and binds only beside
replicas of its own app.

A claim is a Unix socket in the abstract namespace, bound for as long as the
replica listens, named ``iterserve-port/<port>/<host>/<app key>/<pid>.<nonce>``.
The app key hashes the Ray session's name with the Serve app's name: the
replicas of one app in one Ray cluster share it across redeploys, and no other
server has it. The abstract namespace belongs to the network namespace, as ports
do (a pod, a container, the host), and a name goes away with the socket, so a
replica that dies leaves no stale claim. A replica binds its claim, then reads
every claim on the port (``/proc/net/unix``): another app's claim refuses the
start; a claim of its own app lets it join; with no claim at all, the port must
be free, which a bind without ``SO_REUSEPORT`` tells (a listener of any other
program, or of an iterserve from before claims, fails it). Two apps starting at
once both bind before they read, so at least one sees the other.

``iterserve serve`` runs the same check before it starts anything, which turns
"the port is taken" into a one-line refusal that names the holder instead of a
replica that fails to deploy. Claims are Linux's (abstract Unix sockets); on
other systems a replica shares the port as before.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import socket
import sys
from dataclasses import dataclass

LISTEN_BACKLOG = 2048
CLAIM_PREFIX = "iterserve-port"
CLAIMS = sys.platform.startswith("linux")
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


class PortInUseError(RuntimeError):
    """The port is held by another server; the message names the port and the holder."""


@dataclass(frozen=True)
class Claim:
    name: str  # the abstract socket's name
    host: str  # "*" for a wildcard address, else a short hash of the host
    key: str
    pid: int


def app_key(app_name: str) -> str:
    """What the replicas of Serve app ``app_name`` in this Ray cluster share."""
    import ray

    session = ray.get_runtime_context().get_session_name()
    return hashlib.sha256(f"{session}\0{app_name}".encode()).hexdigest()[:16]


def listen(host: str, port: int, key: str) -> tuple[socket.socket, socket.socket | None]:
    """The listening socket for ``host:port``, shared with the replicas of app
    ``key`` only, and this replica's claim (closed after the listener). Raises
    :class:`PortInUseError` when anything else holds the port."""
    if not CLAIMS:
        return _listening_socket(host, port), None
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"{CLAIM_PREFIX}/{port}/{_host_tag(host)}/{key}/{os.getpid()}.{secrets.token_hex(4)}"
    try:
        claim.bind("\0" + name)
        check(host, port, key, own=name)
        return _listening_socket(host, port), claim
    except BaseException:
        claim.close()
        raise


def check(host: str, port: int, key: str | None = None, own: str = "") -> None:
    """Raises :class:`PortInUseError` unless ``host:port`` is free or held only by
    replicas of app ``key`` (None: of no app, as for a server about to start its
    own Ray)."""
    if not CLAIMS and key is not None:
        return  # nothing tells our own replicas from others here
    tag = _host_tag(host)
    claims = [c for c in _claims(port) if c.name != own and _overlaps(c.host, tag)]
    foreign = [c for c in claims if c.key != key]
    if foreign:
        raise PortInUseError(_in_use(port, foreign[0].pid))
    if not claims:  # no replica of this app holds it, so nothing else may either
        with _socket(host) as probe:
            try:
                probe.bind((host, port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                raise PortInUseError(_in_use(port, _listener_pid(port))) from None


def _listening_socket(host: str, port: int) -> socket.socket:
    sock = _socket(host)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        raise PortInUseError(_in_use(port, _listener_pid(port))) from None
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def accept_queued(listener: socket.socket) -> list[socket.socket]:
    """Every connection waiting in non-blocking ``listener``'s queue, accepted now
    (non-blocking, as an event loop takes them)."""
    accepted = []
    while True:
        try:
            connection, _ = listener.accept()
        except BlockingIOError:
            return accepted
        except ConnectionAbortedError:  # the client gave up while it waited
            continue
        connection.setblocking(False)
        accepted.append(connection)


def _socket(host: str) -> socket.socket:
    """A TCP socket for ``host``; ``SO_REUSEADDR`` so that connections of an earlier
    server still in TIME_WAIT do not hold the port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def _host_tag(host: str) -> str:
    return "*" if host in WILDCARD_HOSTS else hashlib.sha256(host.encode()).hexdigest()[:8]


def _overlaps(a: str, b: str) -> bool:
    return a == b or "*" in (a, b)


def _claims(port: int) -> list[Claim]:
    """Every claim on ``port`` in this network namespace."""
    prefix = f"@{CLAIM_PREFIX}/{port}/"
    claims = []
    with open("/proc/net/unix") as table:
        for line in table:
            path = line.split()[-1]
            if not path.startswith(prefix):
                continue
            parts = path[1:].split("/")
            if len(parts) == 5 and parts[4].split(".")[0].isdigit():
                claims.append(Claim(path[1:], parts[2], parts[3], int(parts[4].split(".")[0])))
    return claims


def _listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port``, where this user may see it."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{fields[9]}]")
        except OSError:
            continue
    for pid in filter(str.isdigit, _listdir("/proc")):
        for fd in _listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return int(pid)
            except OSError:
                continue
    return None


def _in_use(port: int, pid: int | None) -> str:
    if pid is None:
        return f"port {port} is in use by another server (its process is not visible to this user)"
    launcher = _launcher(pid)
    holder = launcher or pid
    return f"port {port} is in use by another server (pid {holder}, {_cmdline(holder)})"


def _launcher(pid: int) -> int | None:
    """The ``iterserve serve`` process that started ``pid``'s Ray, if it did (an
    ingress replica is the raylet's child, the raylet that command's)."""
    for _ in range(8):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if pid <= 1:
            return None
        argv = _argv(pid)
        names = [os.path.basename(arg) for arg in argv]
        if "serve" in argv and ("iterserve" in names or "iterserve.cli" in argv):
            return pid
    return None


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _cmdline(pid: int, limit: int = 100) -> str:
    """A process's command line as a user reads it: a script's name, not the
    interpreter's path before it (``python -m`` and ``-c`` stay)."""
    argv = _argv(pid)
    if len(argv) > 1 and os.path.basename(argv[0]).startswith("python"):
        argv = argv[1:] if not argv[1].startswith("-") else ["python", *argv[1:]]
    if argv:
        argv[0] = os.path.basename(argv[0])
    text = " ".join(" ".join(argv).split()) or "its command line is not visible"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
