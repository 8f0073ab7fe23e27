"""The KV cache tiers measured through the real server (``iterserve serve``), one
invocation per goal, the tiers on against a baseline in the same sitting:

- ``restart``: 6 requests, each opening with its own ~1.5k-token prefix, one at
  a time; the server stopped and started again on the same ``kv_disk_cache_dir``;
  the same requests: first-token time (p50) against the cold server's,
  ``cached_tokens`` and the greedy text of each;
- ``eviction``: the device arena holds about two of those prefixes, the host
  tier is on, the six go twice in turn: the second round's TTFT against the first's;
- ``swap``: 32 requests of 64 prompt / 1024 output tokens together, the arena
  holding about 8 at full length: with the host tier (preemption swaps) against
  without (recompute): recomputed tokens (the engine's counter), E2E p99, the
  outputs token for token;
- ``no-reuse``: vLLM's own client (``../shared/peer/bench_client.sh``, 64 x 512/64,
  prompts never repeat) against the server with the tiers on and off, alternating.

Nothing asserts on time; the figures are printed with their ratios. Take them
under ``flock /tmp/iterserve-bench.lock``: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SERVE_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``iterserve serve`` on the demo model with ``flags``, stopped by SIGTERM."""

    def __init__(self, flags: list[str], log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(ROOT / ".venv/bin/iterserve"), "serve", str(ROOT / "models/demo"),
               "--port", str(self.port), "--served-model-name", "demo", *flags]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up; see {log}")
            time.sleep(1.0)

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/stats", timeout=30).json()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: TTFT, E2E, its tokens' text, cached prompt tokens."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    ttft, text, cached = None, [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - start
                text.append(chunk["choices"][0].get("text", ""))
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": ttft, "e2e": time.perf_counter() - start, "text": "".join(text),
            "cached": cached}  # fmt: skip


def _run(url: str, prompts: list[list[int]], max_tokens: int, together: bool) -> list[dict]:
    async def go():
        limits = httpx.Limits(max_connections=len(prompts) + 4)
        async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
            if together:
                return await asyncio.gather(*(_one(client, url, p, max_tokens) for p in prompts))
            return [await _one(client, url, p, max_tokens) for p in prompts]

    return asyncio.run(go())


def prefixed_prompts(n: int = 6, prefix_len: int = 1500, seed: int = 0) -> list[list[int]]:
    """``n`` prompts, each its own ``prefix_len``-token prefix and a short question."""
    rng = random.Random(seed)
    return [[rng.randrange(5, 4000) for _ in range(prefix_len + 12)] for _ in range(n)]


def _p50(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _p99(rows: list[dict], key: str) -> float:
    values = sorted(r[key] for r in rows)
    return values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]


BASE = ["--max-model-len", "2048", "--dtype", "float32"]


def restart(args) -> dict:
    disk = Path(tempfile.mkdtemp(prefix="iterserve-kv-"))
    flags = [*BASE, "--kv-offloading-size", "0.5", "--kv-disk-cache-dir", str(disk),
             "--kv-disk-cache-size", "2"]  # fmt: skip
    prompts = prefixed_prompts()
    rounds, stats = [], []
    for _ in range(2):
        server = Server(flags, args.log)
        try:
            rounds.append(_run(server.url, prompts, 16, together=False))
            time.sleep(2.0)  # the disk's writer finishes before the server goes
            stats.append(_tier_stats(server.stats()))
        finally:
            server.stop()
    shutil.rmtree(disk, ignore_errors=True)
    cold, warm = rounds
    return {
        "ttft_p50_cold_s": _p50(cold, "ttft"), "ttft_p50_warm_s": _p50(warm, "ttft"),
        "ttft_ratio": _p50(warm, "ttft") / _p50(cold, "ttft"),
        "cached_tokens_warm": [r["cached"] for r in warm],
        "same_text": [a["text"] == b["text"] for a, b in zip(cold, warm)],
        "stats": stats,
    }  # fmt: skip


def eviction(args) -> dict:
    flags = [*BASE, "--num-kv-blocks", "200", "--kv-offloading-size", "0.5"]
    prompts = prefixed_prompts(seed=1)
    server = Server(flags, args.log)
    try:
        first = _run(server.url, prompts, 16, together=False)
        second = _run(server.url, prompts, 16, together=False)
        stats = server.stats()
    finally:
        server.stop()
    return {
        "ttft_p50_first_s": _p50(first, "ttft"), "ttft_p50_second_s": _p50(second, "ttft"),
        "ttft_ratio": _p50(second, "ttft") / _p50(first, "ttft"),
        "cached_tokens_second": [r["cached"] for r in second],
        "same_text": [a["text"] == b["text"] for a, b in zip(first, second)],
        "stats": _tier_stats(stats),
    }  # fmt: skip


def swap(args) -> dict:
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 4000) for _ in range(64)] for _ in range(32)]
    modes = {"recompute": [], "swap": ["--kv-offloading-size", "1"]}
    runs: dict[str, list[dict]] = {"recompute": [], "swap": []}
    for i in range(args.rounds):  # alternating, the order flipped each round
        for mode in list(modes) if i % 2 == 0 else list(modes)[::-1]:
            server = Server([*BASE, "--num-kv-blocks", "544", *modes[mode]], args.log)
            try:
                rows = _run(server.url, prompts, 1024, together=True)
                stats = server.stats()
            finally:
                server.stop()
            runs[mode].append({"e2e_p99_s": _p99(rows, "e2e"), "e2e_p50_s": _p50(rows, "e2e"),
                               "stats": _tier_stats(stats), "texts": [r["text"] for r in rows]})  # fmt: skip
    texts = {tuple(run["texts"]) for mode in runs for run in runs[mode]}

    def median(mode: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[mode])

    return {
        "recomputed_tokens": {
            m: [r["stats"].get("num_recomputed_tokens") for r in runs[m]] for m in runs
        },  # fmt: skip
        "preemptions": {m: [r["stats"].get("num_preemptions") for r in runs[m]] for m in runs},
        "e2e_p99_s": {m: [r["e2e_p99_s"] for r in runs[m]] for m in runs},
        "e2e_p50_s": {m: [r["e2e_p50_s"] for r in runs[m]] for m in runs},
        "e2e_p99_ratio": median("swap", "e2e_p99_s") / median("recompute", "e2e_p99_s"),
        "e2e_p50_ratio": median("swap", "e2e_p50_s") / median("recompute", "e2e_p50_s"),
        "same_outputs": len(texts) == 1,
    }


def no_reuse(args) -> dict:
    results: dict[str, list[float]] = {"off": [], "on": []}
    disk = Path(tempfile.mkdtemp(prefix="iterserve-kv-"))
    tiers = ["--kv-offloading-size", "0.5", "--kv-disk-cache-dir", str(disk)]
    for i in range(args.rounds):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            server = Server([*BASE, *(tiers if mode == "on" else [])], args.log)
            out = Path(tempfile.mkstemp(suffix=".json")[1])
            try:
                env = dict(os.environ, BASE_URL=server.url, MODEL="demo", INPUT_LEN="512",
                           OUTPUT_LEN="64", NUM_PROMPTS="64", IGNORE_EOS="1", OUT=str(out),
                           SEED=str(i))  # fmt: skip
                subprocess.run(["bash", str(ROOT.parent / "shared/peer/bench_client.sh")],
                               env=env, cwd=ROOT, check=True, capture_output=True)  # fmt: skip
                results[mode].append(json.loads(out.read_text())["output_throughput"])
            finally:
                server.stop()
    shutil.rmtree(disk, ignore_errors=True)
    return {
        "output_tok_s": results,
        "ratio_on_off": statistics.median(results["on"]) / statistics.median(results["off"]),
    }


def _tier_stats(stats: dict) -> dict:
    engine = stats["replicas"][0] if stats.get("replicas") else stats
    keys = ("num_preemptions", "num_recomputed_tokens", "prefix_cache_hits", "kv_host_hits",
            "kv_disk_hits", "kv_stores", "kv_loads", "kv_reads", "kv_reads_failed", "kv_writes",
            "kv_writes_dropped")  # fmt: skip
    return {k: engine.get(k) for k in keys if k in engine}


GOALS = {"restart": restart, "eviction": eviction, "swap": swap, "no-reuse": no_reuse}


def register(benches) -> None:
    p = benches.add_parser("kv-tiers", help="the KV cache tiers through the real server: "
                           "restart, eviction, swap, no-reuse")  # fmt: skip
    p.add_argument("--goal", choices=sorted(GOALS), required=True)
    p.add_argument("--rounds", type=int, default=2, help="swap, no-reuse: alternating rounds")
    p.add_argument("--log", type=Path, default=Path("kv-tiers-server.log"))
    p.add_argument("--json", help="also write the result to this file")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    result = GOALS[args.goal](args)
    printed = {k: v for k, v in result.items() if k != "texts"}
    print(json.dumps(printed, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
