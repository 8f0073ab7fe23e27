"""What ``iterserve serve`` exposes: Ray without its dashboard, Jobs API or client
server, and Serve's HTTP proxy on the requested host only.

(Ray's own gRPC ports — GCS, raylet, object manager, workers — listen on every
interface whatever the node address; docs/reliability.md says how to fence them.)
"""

from __future__ import annotations

import psutil
import pytest
import ray
from ray import serve

from iterserve.cluster.serve.cli import run_server
from iterserve.scheduler import FakeModel

RAY_PUBLIC_PORTS = {8265: "dashboard / Jobs API", 10001: "Ray client server"}


class _Stop(Exception):
    pass


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_run_server_starts_ray_without_dashboard_and_serve_on_the_given_host(monkeypatch, host):
    calls = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.setdefault("ray", kwargs))

    def start(**kwargs):
        calls["serve"] = kwargs
        raise _Stop  # nothing is started for real

    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(serve, "shutdown", lambda: calls.setdefault("serve_shutdown", True))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.setdefault("ray_shutdown", True))
    with pytest.raises(_Stop):
        run_server(host=host, port=8123, executor=FakeModel())
    assert calls["ray"]["address"] == "local"  # a fresh single-node Ray, never a cluster's
    assert calls["ray"]["include_dashboard"] is False
    assert calls["ray"]["_system_config"] == {"worker_niceness": 0}
    # No proxy: the ingress answers HTTP on host:port itself (the session's test below
    # checks where a proxy listens, the quick-start test where the ingress does).
    assert calls["serve"] == {"proxy_location": "Disabled"}
    # A start-up that fails stops what it started: the Ray it started, Serve with it.
    assert calls["ray_shutdown"]


def _listeners(pids: set[int]) -> list[tuple[str, int, int]]:
    return [
        (c.laddr.ip, c.laddr.port, c.pid)
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]


def test_the_session_serves_http_on_loopback_only_and_runs_no_dashboard(serve_url):
    ours = {p.pid: p for p in psutil.Process().children(recursive=True)}
    listeners = _listeners(set(ours))
    port = int(serve_url.rsplit(":", 1)[1])
    http = [(ip, pid) for ip, p, pid in listeners if p == port]
    assert http and all(ip == "127.0.0.1" for ip, _ in http), http
    exposed = {RAY_PUBLIC_PORTS[p]: ip for ip, p, _ in listeners if p in RAY_PUBLIC_PORTS}
    assert exposed == {}
    cmdlines = []
    for proc in ours.values():
        try:
            cmdlines.append(" ".join(proc.cmdline()))
        except psutil.Error:
            continue
    # Ray starts a head "dashboard" process even without the dashboard; it must serve
    # no frontend (and so no Jobs API), and no Ray client server may run.
    heads = [c for c in cmdlines if "dashboard/dashboard.py" in c]
    assert all("--disable-frontend" in c for c in heads), heads
    assert not [c for c in cmdlines if "ray.util.client.server" in c]
    print()
    for ip, p, pid in sorted(listeners):
        print(f"  listening {ip}:{p} ({ours[pid].name()})")
