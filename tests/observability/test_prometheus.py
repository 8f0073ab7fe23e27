"""A real Prometheus scraping an engine's exposition over loopback."""

from __future__ import annotations

import http.server
import threading

import pytest

from iterserve.cluster.metrics.hub import CONTENT_TYPE, render_local
from tests.observability.prom import PROMETHEUS, all_panel_queries, query, run_prometheus, wait_for

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus; CI does)"
)


@pytest.fixture
def metrics_server(busy_metrics):
    """``GET /metrics`` on a free loopback port, serving two engines' merged exposition."""
    engines = [busy_metrics("demo", 0, "static"), busy_metrics("demo", 1, "chunked")]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = render_local(engines)
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # keep test output quiet
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_prometheus_scrapes_our_metrics_and_evaluates_every_panel(metrics_server):
    with run_prometheus(metrics_server, scrape_interval="1s") as base_url:
        up = wait_for(lambda: query(base_url, "up == 1"), timeout_s=30)
        assert up, "the target was never scraped successfully"
        running = wait_for(lambda: query(base_url, "iterserve_requests_running"), timeout_s=10)
        assert {(r["metric"]["model_name"], r["metric"]["engine"]) for r in running} == {
            ("demo", "0"),
            ("demo", "1"),
        }
        assert {r["value"][1] for r in running} == {"2"}
        # Every panel query evaluates (rates have no data yet this early, but a PromQL
        # or label-matching error would fail the call).
        failures = []
        for dashboard, title, expr in all_panel_queries():
            try:
                query(base_url, expr)
            except ValueError as exc:
                failures.append(f"{dashboard} / {title}: {exc}")
        assert failures == []
        policies = query(base_url, "iterserve_policy_info")
        assert {r["metric"]["policy"] for r in policies} == {"static", "chunked"}
