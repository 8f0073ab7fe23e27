"""The load generator against a stub server that streams completions as SSE."""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from iterserve.bench import loadgen
from iterserve.bench.report import RequestTiming, percentile, summarize


class StubHandler(BaseHTTPRequestHandler):
    """``/v1/completions``: one SSE chunk per token, ``gap_s`` apart; every
    ``reject_every``-th request gets a 429; ``/v1/models`` is a model card."""

    protocol_version = "HTTP/1.1"
    server: StubServer

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        card = {"id": "stub-model", "object": "model", "max_model_len": 512}
        self._send(200, json.dumps({"object": "list", "data": [card]}).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        stub = self.server
        with stub.lock:
            stub.bodies.append(body)
            number = len(stub.bodies)
        if stub.reject_every and number % stub.reject_every == 0:
            self._send(429, b'{"error": {"message": "queue full"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i in range(body["max_tokens"]):
                time.sleep(stub.gap_s)
                chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]}
                self._chunk(f"data: {json.dumps(chunk)}\n\n")
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            self._chunk(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the client's wall-clock cap
            pass

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


class StubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, gap_s: float = 0.002, reject_every: int = 0):
        super().__init__(("127.0.0.1", 0), StubHandler)
        self.gap_s, self.reject_every = gap_s, reject_every
        self.bodies: list[dict] = []
        self.lock = threading.Lock()

    def handle_error(self, request, client_address) -> None:
        pass


@pytest.fixture
def stub():
    servers = []

    def start(**kwargs) -> tuple[StubServer, str]:
        server = StubServer(**kwargs)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    loadgen.register(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["serve", *argv])


def test_every_request_streams_its_tokens_and_the_figures_add_up(stub, tmp_path):
    server, url = stub()
    out = tmp_path / "serve.json"
    args = parse("--url", url, "--dataset", "fixed", "--input-len", "5", "--output-len", "6",
                 "--num-prompts", "12", "--request-rate", "200", "--json", str(out),
                 "--slo-ttft", "10", "--slo-itl", "10", "--no-progress")  # fmt: skip
    args.func(args)
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert run["num_completed"] == 12 and run["num_errors"] == 0 and run["errors"] == {}
    assert run["num_output_tokens"] == 12 * 6
    assert run["num_prompt_tokens"] == 12 * 5
    assert run["goodput_req_s"] == run["request_throughput_req_s"] > 0
    for name in ("ttft", "itl", "tpot", "e2e"):
        assert 0 < run[f"{name}_p50_s"] <= run[f"{name}_p90_s"] <= run[f"{name}_p99_s"]
    # The request carries what the benchmark controls: lengths, streaming, no early EOS.
    body = server.bodies[0]
    assert body["model"] == "stub-model" and body["stream"] and body["ignore_eos"]
    assert len(body["prompt"]) == 5 and body["max_tokens"] == 6
    assert result["config"]["max_model_len"] == 512


def test_refusals_are_counted_by_status(stub):
    _, url = stub(reject_every=3)
    args = parse("--url", url, "--dataset", "fixed", "--input-len", "4", "--output-len", "3",
                 "--num-prompts", "9", "--no-progress")  # fmt: skip
    (run,) = loadgen.benchmark(args)["runs"]
    assert run["errors"] == {"429": 3}
    assert run["num_completed"] == 6


def test_the_wall_clock_cap_ends_the_run(stub):
    _, url = stub(gap_s=0.5)
    args = parse("--url", url, "--dataset", "fixed", "--input-len", "4", "--output-len", "100",
                 "--num-prompts", "3", "--max-duration", "1.0", "--no-progress")  # fmt: skip
    start = time.monotonic()
    (run,) = loadgen.benchmark(args)["runs"]
    assert time.monotonic() - start < 10
    assert run["errors"] == {"cancelled_at_cap": 3}


def test_max_concurrency_bounds_requests_in_flight(stub):
    _, url = stub(gap_s=0.01)
    items = loadgen.fixed_items(8, np.random.default_rng(0), 4, 5, 256)
    timings, _ = loadgen.asyncio.run(loadgen.run_load(
        url, items, [0.0] * 8, model="m", max_concurrency=2, progress=False))  # fmt: skip
    spans = [(t.sent_s, t.chunks[-1][0]) for t in timings]
    for t, _ in spans:
        assert sum(1 for s, e in spans if s <= t < e) <= 2


def test_a_sweep_runs_each_rate_and_draws_its_plot(stub, tmp_path):
    pytest.importorskip("matplotlib")
    _, url = stub()
    png = tmp_path / "sweep.png"
    args = parse("--url", url, "--dataset", "longtail", "--num-prompts", "6",
                 "--request-rates", "50,100", "--png", str(png), "--no-progress",
                 "--max-model-len", "96")  # fmt: skip
    args.func(args)
    assert png.stat().st_size > 1000


def test_remote_hosts_are_refused():
    with pytest.raises(SystemExit, match="loopback"):
        loadgen.benchmark(parse("--url", "http://10.1.2.3:8000", "--no-progress"))


# -- datasets, arrivals and figures ------------------------------------------------------------


def test_longtail_mixes_short_chats_and_long_prompts_within_the_context():
    items = loadgen.longtail_items(400, np.random.default_rng(1), 1024, 4096)
    prompts = np.array([i.prompt_len for i in items])
    outputs = np.array([i.output_len for i in items])
    assert all(len(i.prompt) == i.prompt_len for i in items)
    assert max(p + o for p, o in zip(prompts, outputs)) <= 1024
    assert 0.15 < np.mean(prompts >= 256) < 0.35  # the RAG-style share
    assert np.median(outputs) < 100 and outputs.max() > 3 * np.median(outputs)  # heavy tail
    again = loadgen.longtail_items(400, np.random.default_rng(1), 1024, 4096)
    assert [i.prompt for i in again] == [i.prompt for i in items]


def test_sharegpt_takes_the_first_human_and_gpt_turns(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "one two three"},
                           {"from": "gpt", "value": "a b c d e f g h i j"}]},
        {"conversations": [{"from": "gpt", "value": "no question"}]},
        {"conversations": [{"from": "human", "value": "long " * 900},
                           {"from": "gpt", "value": "x"}]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    items = loadgen.sharegpt_items(str(path), 10, np.random.default_rng(0), 512)
    assert len(items) == 1  # one has no human turn, one does not fit in the context
    assert items[0].prompt == "one two three"
    assert (items[0].prompt_len, items[0].output_len) == (4, 13)  # ~1.3 tokens per word


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_keep_the_mean_rate_whatever_the_burstiness(burstiness):
    offsets = loadgen.arrival_offsets(4000, 20.0, burstiness, np.random.default_rng(0))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.mean(gaps) == pytest.approx(0.05, rel=0.1)
    # Coefficient of variation of gamma gaps is 1/sqrt(shape).
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.15)
    assert loadgen.arrival_offsets(3, math.inf, 1.0, np.random.default_rng(0)) == [0.0] * 3


def test_itl_spreads_a_multi_token_chunk_and_tpot_excludes_the_first_token():
    t = RequestTiming(sent_s=0.0, chunks=[(1.0, 1), (1.5, 1), (2.5, 2)])
    assert t.ttft_s == 1.0 and t.e2e_s == 2.5 and t.num_tokens == 4
    assert t.itl_s() == [0.5, 0.5, 0.5]
    assert t.tpot_s == pytest.approx(0.5)
    summary = summarize([t, RequestTiming(sent_s=0.0, error="429")], makespan_s=2.5)
    assert summary["num_errors"] == 1 and summary["throughput_tok_s"] == pytest.approx(1.6)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 99) is None
