"""Helpers for testing metrics and dashboards against the real Prometheus tools.

- ``all_panel_queries()``: every PromQL expression of the Grafana dashboards, with the
  template variables replaced so Prometheus' HTTP API can evaluate it as is;
- ``families_in(expr)``: the metric families an expression reads;
- ``promtool_check(text)``: ``promtool check metrics`` over an exposition;
- ``run_prometheus(host_port)``: a throwaway Prometheus scraping one target;
- ``query(base_url, expr)``: an instant query through the HTTP API.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from iterserve.cluster.metrics.engine import METRIC_NAMES

GRAFANA_DIR = Path(__file__).resolve().parents[2] / "grafana"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

# Series-name suffixes Prometheus adds to a family name (see cluster/metrics/engine.py).
SERIES_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
_IDENTIFIER = re.compile(r"\biterserve_[a-zA-Z0-9_]*")
# Grafana's own variables, fixed to what a 1 s scrape interval supports.
_GRAFANA_VARS = {
    "$__rate_interval": "1m",
    "${__rate_interval}": "1m",
    "$__interval": "1m",
    "${__interval}": "1m",
    "$__range": "5m",
    "${__range}": "5m",
}


def load_dashboards() -> dict[str, dict]:
    """File name (without .json) -> parsed dashboard."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(GRAFANA_DIR.glob("*.json"))}


def iter_panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def substitute(expr: str) -> str:
    """A Grafana query made evaluable by Prometheus: every model selected."""
    for variable, value in _GRAFANA_VARS.items():
        expr = expr.replace(variable, value)
    return expr.replace("${model_name}", ".*").replace("$model_name", ".*")


def all_panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) for every query target of every panel."""
    out = []
    for name, dashboard in load_dashboards().items():
        for panel in iter_panels(dashboard):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    out.append((name, panel["title"], substitute(target["expr"])))
    return out


def family_of(series_name: str) -> str:
    """``iterserve_x_total`` / ``_bucket`` / ``_sum`` / ``_count`` -> family ``iterserve_x``."""
    if series_name in METRIC_NAMES:
        return series_name
    for suffix in SERIES_SUFFIXES:
        if series_name.endswith(suffix):
            return series_name[: -len(suffix)]
    return series_name


def families_in(expr: str) -> set[str]:
    return {family_of(name) for name in _IDENTIFIER.findall(expr)}


def promtool_check(exposition: bytes) -> subprocess.CompletedProcess:
    """``promtool check metrics`` reads the exposition on stdin; lint problems go to
    stdout/stderr, so a clean result is exit 0 with no output at all."""
    return subprocess.run(
        [PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, timeout=30
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@contextlib.contextmanager
def run_prometheus(
    scrape_url_host_port: str,
    scrape_interval: str = "1s",
    *,
    metrics_path: str = "/metrics",
    ready_timeout_s: float = 30.0,
) -> Iterator[str]:
    """Starts ``prometheus`` on a free loopback port scraping one target; yields its base
    URL once ``/-/ready`` answers, and stops it (and its temp dir) on exit."""
    if PROMETHEUS is None:
        raise FileNotFoundError("the prometheus binary is not installed")
    with tempfile.TemporaryDirectory(prefix="iterserve-prom-") as tmp:
        config = Path(tmp) / "prometheus.yml"
        # scrape_timeout defaults to 10 s, which Prometheus refuses above the interval.
        config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval}\n"
            f"  scrape_timeout: {scrape_interval}\n"
            f"  evaluation_interval: {scrape_interval}\n"
            "scrape_configs:\n"
            "  - job_name: iterserve\n"
            f"    metrics_path: {metrics_path}\n"
            "    static_configs:\n"
            f"      - targets: ['{scrape_url_host_port}']\n"
        )
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        log_path = Path(tmp) / "prometheus.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={Path(tmp) / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait_ready(proc, base_url, ready_timeout_s, log_path)
            yield base_url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _wait_ready(proc: subprocess.Popen, base_url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{log.read_text()}")
        with contextlib.suppress(OSError):
            if _get(base_url + "/-/ready")[0] == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"prometheus not ready after {timeout_s} s:\n{log.read_text()}")


def query(base_url: str, expr: str, timeout: float = 5.0) -> list[dict]:
    """An instant query; returns the result vector (raises on a PromQL error)."""
    url = f"{base_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    status, body = _get(url, timeout)
    payload = json.loads(body)
    if status != 200 or payload.get("status") != "success":
        raise ValueError(f"query {expr!r} failed ({status}): {payload.get('error', body)}")
    return payload["data"]["result"]


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.25):
    """Polls ``predicate`` until it returns something truthy; returns that, or the last
    falsy value once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)
