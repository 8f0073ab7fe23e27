"""A port belongs to one server: the ingress's listener is shared only with
replicas of its own app (cluster/serve/ports.py), here with plain sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from iterserve.cluster.serve import ports
from iterserve.cluster.serve.ports import PortInUseError
from tests.serve.conftest import _free_port

pytestmark = pytest.mark.skipif(not ports.CLAIMS, reason="claims are Linux's")


def _connects(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=5):
        return True


def test_replicas_of_one_app_share_the_port_and_another_app_is_refused_by_name():
    port = _free_port()
    first, first_claim = ports.listen("127.0.0.1", port, "app-a")
    second, second_claim = ports.listen("127.0.0.1", port, "app-a")  # a redeploy's successor
    try:
        assert _connects("127.0.0.1", port)
        with pytest.raises(PortInUseError) as refused:
            ports.listen("127.0.0.1", port, "app-b")
        assert f"port {port} is in use by another server (pid {os.getpid()}, " in str(refused.value)
        with pytest.raises(PortInUseError):  # a server about to start its own Ray
            ports.check("127.0.0.1", port, None)
        ports.check("127.0.0.1", port, "app-a")
    finally:
        for sock in (first, first_claim, second, second_claim):
            sock.close()
    # No claim outlives its socket: the port is anyone's again.
    again, claim = ports.listen("127.0.0.1", port, "app-b")
    again.close()
    claim.close()


def test_a_wildcard_address_overlaps_every_host_and_two_hosts_do_not():
    port = _free_port()
    wildcard, claim = ports.listen("0.0.0.0", port, "app-a")
    try:
        with pytest.raises(PortInUseError, match=f"port {port}"):
            ports.listen("127.0.0.1", port, "app-b")
    finally:
        wildcard.close()
        claim.close()
    one = ports.listen("127.0.0.1", port, "app-a")
    other = ports.listen("127.0.0.2", port, "app-b")  # another address: no conflict
    for sock in (*one, *other):
        sock.close()


def _hold(port: int, reuseport: bool, tmp_path) -> subprocess.Popen:
    """Another program listening on ``port``; it prints when it does."""
    script = tmp_path / "other_server.py"
    script.write_text(
        "import socket, sys, time\n"
        "s = socket.socket()\n"
        f"s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, {int(reuseport)})\n"
        f"s.bind(('127.0.0.1', {port})); s.listen()\n"
        "print('listening', flush=True); time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening"
    return proc


@pytest.mark.parametrize("reuseport", [False, True], ids=["plain", "reuseport"])
def test_a_port_another_program_listens_on_is_refused_naming_it(reuseport, tmp_path):
    """A plain listener fails the bind itself; one with ``SO_REUSEPORT`` (of this
    user, as an iterserve from before claims) would have been joined silently."""
    port = _free_port()
    holder = _hold(port, reuseport, tmp_path)
    script = "other_server.py"
    try:
        for attempt in (
            lambda: ports.listen("127.0.0.1", port, "app-a"),
            lambda: ports.check("127.0.0.1", port, None),
        ):
            with pytest.raises(PortInUseError) as refused:
                attempt()
            message = str(refused.value)
            assert (
                message == f"port {port} is in use by another server (pid {holder.pid}, {script})"
            )
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 10
    while True:  # the holder's socket goes with it
        try:
            sock, claim = ports.listen("127.0.0.1", port, "app-a")
            break
        except PortInUseError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    sock.close()
    claim.close()
