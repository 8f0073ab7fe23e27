"""Side by side: one workload against iterserve and a second OpenAI-compatible server.

``iterserve bench compare --b-url http://127.0.0.1:8100 --b-model models/demo``
starts ``iterserve serve`` as a user would (no config, Ray sized by the
machine) unless ``--a-url`` names a running one, then runs the same requests
against each server in alternating rounds (A B, B A, ...), so a drift of the
machine's speed lands on both. Every request streams, all sent at once by
default, as vLLM's ``vllm bench serve`` sends them. It prints, per server, the
medians over rounds of output throughput, TTFT, ITL and E2E, their ratios A/B,
and the CPU each server's processes spent per output token (for iterserve also
without the rank's model forward: the serving path's own cost). ``--vllm``
names a ``vllm`` executable whose ``bench serve`` client then also runs
against both, so the figures exist under that client too.

At a real size: ``--shape llama-1b`` (:mod:`iterserve.bench.shapes`) builds that
random-weight checkpoint once (under ``~/.cache/iterserve/shapes``), serves it
and draws prompts from its tokenizer; ``--model PATH`` serves any checkpoint;
``--dtype`` sets the served dtype (default: what ``auto`` picks). The other
server must be started on the same checkpoint: its path is printed first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from .loadgen import Item, fixed_items, run_load
from .report import summarize, write_json

METRICS = (  # key, label, better
    ("throughput_tok_s", "output tok/s", "higher"),
    ("ttft_p50_s", "TTFT p50 (s)", "lower"),
    ("ttft_mean_s", "TTFT mean (s)", "lower"),
    ("itl_p50_s", "ITL p50 (s)", "lower"),
    ("e2e_p50_s", "E2E p50 (s)", "lower"),
)


@dataclass
class Server:
    """A server under test, and the process tree whose CPU it spends."""

    name: str
    url: str
    model: str
    pid: int | None = None  # root of its process tree; None: CPU is not measured
    iterserve: bool = False  # reads the ranks' forward time from /v1/stats
    runs: list[dict] = field(default_factory=list)

    def cpu_seconds(self) -> float | None:
        if self.pid is None:
            return None
        import psutil

        total = 0.0
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return None
        for proc in procs:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                continue
        return total

    def forward_seconds(self) -> float | None:
        if not self.iterserve:
            return None
        import httpx

        stats = httpx.get(f"{self.url}/v1/stats", timeout=30).json()
        return sum(r.get("timing", {}).get("forward_s", 0.0) for r in stats["replicas"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_iterserve(
    port: int,
    log_path: str,
    timeout_s: float = 600.0,
    *,
    model: str | None = None,
    dtype: str | None = None,
) -> subprocess.Popen:
    """``iterserve serve`` on ``port``, as the README says to run it: no config, or
    only the checkpoint and the dtype asked for."""
    import httpx

    cmd = [os.path.join(os.path.dirname(sys.executable), "iterserve"), "serve", "--port", str(port)]
    if model:
        cmd += ["--model", model]
    if dtype:
        config = os.path.join(os.path.dirname(log_path), "iterserve-config.json")
        with open(config, "w") as f:
            json.dump({"dtype": dtype}, f)
        cmd += ["--config", config]
    log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until it stops
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"iterserve serve exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"iterserve serve was not healthy within {timeout_s:g} s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def one_run(server: Server, items: list[Item], warmup: list[Item], concurrency) -> dict:
    """Warms the server, then sends ``items`` (all at once) and measures."""
    at_once = [0.0] * len(items)
    asyncio.run(run_load(server.url, warmup, [0.0] * len(warmup), model=server.model,
                         progress=False))  # fmt: skip
    cpu0, fwd0 = server.cpu_seconds(), server.forward_seconds()
    timings, duration = asyncio.run(
        run_load(server.url, items, at_once, model=server.model,
                 max_concurrency=concurrency, progress=False)
    )  # fmt: skip
    cpu1, fwd1 = server.cpu_seconds(), server.forward_seconds()
    summary = summarize(timings, duration)
    tokens = max(summary["num_output_tokens"], 1)
    if cpu0 is not None and cpu1 is not None:
        summary["cpu_ms_per_token"] = round(1000 * (cpu1 - cpu0) / tokens, 4)
        if fwd0 is not None:
            serving = (cpu1 - cpu0) - (fwd1 - fwd0)
            summary["serving_cpu_ms_per_token"] = round(1000 * serving / tokens, 4)
    return summary


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 5) if values else None


def summarize_servers(a: Server, b: Server) -> dict:
    out: dict = {"servers": {}, "ratios_a_over_b": {}}
    keys = [k for k, _, _ in METRICS] + ["cpu_ms_per_token", "serving_cpu_ms_per_token"]
    for server in (a, b):
        out["servers"][server.name] = {k: _median(server.runs, k) for k in keys}
        out["servers"][server.name]["url"] = server.url
        out["servers"][server.name]["rounds"] = server.runs
    for key, _, _ in METRICS:
        va, vb = out["servers"][a.name][key], out["servers"][b.name][key]
        out["ratios_a_over_b"][key] = round(va / vb, 3) if va and vb else None
    return out


def vllm_client_run(vllm: str, server: Server, args, tokenizer: str, out_dir: str) -> dict:
    """vLLM's own ``vllm bench serve`` against ``server``, the same workload shape."""
    out = os.path.join(out_dir, f"vllm-client-{server.name}.json")
    cmd = [
        vllm, "bench", "serve", "--backend", "openai", "--base-url", server.url,
        "--endpoint", "/v1/completions", "--model", server.model, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(args.seed),
        "--num-warmups", str(args.warmups), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-result",
        "--result-dir", out_dir, "--result-filename", os.path.basename(out),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, env=env, capture_output=True, timeout=1800, check=False)
    data = json.load(open(out))
    keys = ("completed", "failed", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
            "median_itl_ms", "median_tpot_ms", "median_e2el_ms")  # fmt: skip
    return {k: data.get(k) for k in keys}


def render(result: dict, a: str, b: str) -> str:
    sa, sb = result["servers"][a], result["servers"][b]
    lines = [f"{'':18} {a:>14} {b:>14} {a + ' / ' + b:>16}"]
    for key, label, better in METRICS:
        ratio = result["ratios_a_over_b"][key]
        lines.append(f"{label:18} {sa[key]!s:>14} {sb[key]!s:>14} {ratio!s:>9} ({better})")
    for key in ("cpu_ms_per_token", "serving_cpu_ms_per_token"):
        lines.append(f"{key:18} {sa.get(key)!s:>14} {sb.get(key)!s:>14}")
    return "\n".join(lines)


def plot(result: dict, a: str, b: str, path: str) -> None:
    from .plots import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(3 * len(METRICS), 3.2))
    for ax, (key, label, better) in zip(axes, METRICS, strict=True):
        values = [result["servers"][n][key] or 0 for n in (a, b)]
        ax.bar([a, b], values, color=["#4c72b0", "#8c8c8c"])
        ax.set_title(f"{label}\n({better} is better)", fontsize=9)
        for x, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> None:
    from ..models import DEMO_MODEL_PATH

    if args.shape:
        from .shapes import cached_checkpoint

        args.model = str(cached_checkpoint(args.shape))
        print(f"checkpoint {args.shape}: {args.model}", file=sys.stderr)
    tokenizer = args.tokenizer or args.model or str(DEMO_MODEL_PATH)
    # The name iterserve serves a checkpoint under: its directory's.
    args.a_model = args.a_model or (
        os.path.basename(args.model.rstrip("/")) if args.model else "demo"
    )
    from ..workers.tokenizer import Tokenizer

    vocab = Tokenizer(tokenizer).vocab_size
    rng = np.random.default_rng(args.seed)
    items = [fixed_items(args.num_prompts, rng, args.input_len, args.output_len, vocab)]
    warmup = fixed_items(args.warmups, rng, args.input_len, args.output_len, vocab)
    # Each round its own prompts, the same for both servers: a prompt sent again in a
    # later round would be a prefix-cache hit for whichever server keeps it.
    items += [fixed_items(args.num_prompts, rng, args.input_len, args.output_len, vocab)
              for _ in range(args.rounds - 1)]  # fmt: skip
    out_dir = tempfile.mkdtemp(prefix="iterserve-compare-")
    started = None
    if args.a_url:
        a = Server("iterserve", args.a_url.rstrip("/"), args.a_model, args.a_pid, iterserve=True)
    else:
        port = _free_port()
        started = start_iterserve(port, os.path.join(out_dir, "iterserve.log"),
                                  model=args.model, dtype=args.dtype)  # fmt: skip
        a = Server("iterserve", f"http://127.0.0.1:{port}", args.a_model, started.pid, True)
    b = Server(args.b_name, args.b_url.rstrip("/"), args.b_model, args.b_pid)
    try:
        for round_idx in range(args.rounds):
            order = (a, b) if round_idx % 2 == 0 else (b, a)
            for server in order:
                server.runs.append(one_run(server, items[round_idx], warmup, args.max_concurrency))
                print(f"round {round_idx + 1}/{args.rounds} {server.name}: "
                      f"{server.runs[-1]['throughput_tok_s']} tok/s", file=sys.stderr)  # fmt: skip
        result = summarize_servers(a, b)
        result["workload"] = {k: getattr(args, k) for k in
                              ("num_prompts", "input_len", "output_len", "rounds", "seed",
                               "model", "shape", "dtype")}  # fmt: skip
        if args.vllm:
            result["vllm_client"] = {
                s.name: vllm_client_run(args.vllm, s, args, tokenizer, out_dir) for s in (a, b)
            }
    finally:
        if started is not None:
            stop(started)
    write_json(result, args.json)
    if args.png:
        plot(result, a.name, b.name, args.png)
    print(render(result, a.name, b.name))
    if "vllm_client" in result:
        print("under vLLM's client:", json.dumps(result["vllm_client"], indent=1))


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("compare", help="iterserve against another server, side by side")
    p.add_argument("--b-url", required=True, help="the other server's base URL (no /v1)")
    p.add_argument("--b-model", required=True, help="the model name the other server expects")
    p.add_argument("--b-name", default="other", help="what to call it in the report")
    p.add_argument("--b-pid", type=int, help="its process (tree) to measure CPU of")
    p.add_argument("--a-url", help="a running iterserve (default: start iterserve serve)")
    p.add_argument("--a-model", help="the model name iterserve expects (default: its served name)")
    p.add_argument("--model", help="the checkpoint iterserve serves (default: the demo model)")
    p.add_argument("--shape", help="serve a random-weight checkpoint of this named shape")
    p.add_argument("--dtype", help="the dtype iterserve serves in (default: auto)")
    p.add_argument("--a-pid", type=int, help="the running iterserve's process (tree)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, help="default: all requests at once")
    p.add_argument("--warmups", type=int, default=8, help="requests before each measured run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="prompt token ids are drawn from its vocabulary")
    p.add_argument("--vllm", help="a vllm executable: also run its bench serve client")
    p.add_argument("--json", help="also write the result to this file")
    p.add_argument("--png", help="bar charts of the medians")
    p.set_defaults(func=main)
    return p
