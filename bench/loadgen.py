"""Open-loop load against a running server: ``iterserve bench serve --url URL``.

Requests are sent on an arrival schedule drawn up front (Poisson, or gamma with
``--burstiness`` as its shape: < 1 burstier, > 1 steadier), whether or not earlier
ones have finished, so a slow server meets a growing queue rather than a
politely waiting client; ``--max-concurrency`` caps requests in flight.
Every request streams (``/v1/completions``, SSE) with ``ignore_eos`` and
``max_tokens`` set to its dataset output length, so the output length is the
workload's, not the model's. Every run is bounded: by its request count and by
a wall-clock cap after which what is still in flight is cancelled and counted.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlparse

import numpy as np

from .report import RequestTiming, summarize, write_json

DATASETS = ("longtail", "fixed", "sharegpt")


@dataclass
class Item:
    prompt: list[int] | str  # token ids (synthetic data, or tokenized) or text
    prompt_len: int  # exact, or a word-count estimate for untokenized text
    output_len: int


# -- datasets ----------------------------------------------------------------------------


def _lognormal(rng, median: float, sigma: float, lo: int, hi: int, n: int) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(math.log(median), sigma, n)), lo, hi).astype(int)


def longtail_items(n: int, rng, max_model_len: int, vocab_size: int) -> list[Item]:
    """Three in four are short chat turns; one in four is a RAG-style request, a prompt of
    a quarter to half the context and a longer answer. Output lengths are lognormal in
    both: most are short, a few run for hundreds of tokens."""
    quarter = max(2, max_model_len // 4)
    rag = rng.random(n) < 0.25
    chat_prompts = _lognormal(rng, 48, 0.8, 4, quarter, n)
    rag_prompts = rng.integers(quarter, 2 * quarter + 1, n)
    chat_outputs = _lognormal(rng, 48, 1.1, 1, quarter, n)
    rag_outputs = _lognormal(rng, 128, 0.8, 1, quarter, n)
    items = []
    for i in range(n):
        p = int(rag_prompts[i] if rag[i] else chat_prompts[i])
        o = int(min(rag_outputs[i] if rag[i] else chat_outputs[i], max_model_len - p))
        items.append(Item(rng.integers(3, vocab_size, p).tolist(), p, max(o, 1)))
    return items


def fixed_items(n: int, rng, input_len: int, output_len: int, vocab_size: int) -> list[Item]:
    return [
        Item(rng.integers(3, vocab_size, input_len).tolist(), input_len, output_len)
        for _ in range(n)
    ]


def sharegpt_items(
    path: str, n: int, rng, max_model_len: int, tokenizer: str | None = None
) -> list[Item]:
    """Prompt = the first human turn, output length = the first gpt turn's length in
    tokens (with ``tokenizer``; otherwise ~1.3 tokens per whitespace word)."""
    with open(path) as f:
        data = json.load(f)
    tok = None
    if tokenizer:
        from ..workers.tokenizer import Tokenizer

        tok = Tokenizer(tokenizer)
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or []
        human = next((t["value"] for t in turns if t.get("from") == "human"), None)
        gpt = next((t["value"] for t in turns if t.get("from") == "gpt"), None)
        if human and gpt:
            pairs.append((human, gpt))
    items = []
    for k in rng.permutation(len(pairs)):
        human, gpt = pairs[k]
        if tok is not None:
            prompt: list[int] | str = tok.encode(human)
            prompt_len, output_len = len(prompt), len(tok.encode(gpt, add_special_tokens=False))
        else:
            prompt, prompt_len = human, math.ceil(1.3 * len(human.split()))
            output_len = math.ceil(1.3 * len(gpt.split()))
        if prompt_len >= 1 and output_len >= 1 and prompt_len + output_len <= max_model_len:
            items.append(Item(prompt, prompt_len, output_len))
        if len(items) == n:
            break
    if not items:
        raise ValueError(f"{path}: no conversation fits in max_model_len {max_model_len}")
    return items


def arrival_offsets(n: int, rate: float, burstiness: float, rng) -> list[float]:
    """Send times from 0: gamma gaps of mean 1/rate (shape 1 is Poisson); inf: all at once."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# -- sending -------------------------------------------------------------------------------


class Progress:
    """A one-line bar on stderr: small enough to need no dependency."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self.start = total, 0, enabled, time.monotonic()

    def step(self) -> None:
        self.done += 1
        if self.enabled:
            filled = 30 * self.done // max(self.total, 1)
            bar = "#" * filled + "." * (30 - filled)
            elapsed = time.monotonic() - self.start
            sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:.0f}s")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def _stream_one(client, url: str, body: dict, timing: RequestTiming, clock0: float) -> None:
    """One streamed completion; fills ``timing`` (times relative to ``clock0``)."""
    usage_tokens = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            timing.error = str(response.status_code)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                timing.error = "stream_error"
                return
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            if event.get("choices") and event["choices"][0].get("text"):
                timing.add(time.perf_counter() - clock0, 1)
    # A chunk is emitted per text delta; a delta may hold several tokens (a multi-byte
    # character split across tokens): the usage count puts the missing ones on the last.
    if usage_tokens and timing.chunks and usage_tokens > timing.num_tokens:
        t, n = timing.chunks[-1]
        timing.chunks[-1] = (t, n + usage_tokens - timing.num_tokens)


async def run_load(
    url: str,
    items: list[Item],
    offsets: list[float],
    *,
    model: str,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    max_duration_s: float = 600.0,
    progress: bool = True,
) -> tuple[list[RequestTiming], float]:
    """Sends ``items[i]`` at ``offsets[i]``; returns the timings and the wall time from
    the first send to the last response."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or 4096, max_keepalive_connections=64)
    timeout = httpx.Timeout(max_duration_s, connect=10.0)
    gate = asyncio.Semaphore(max_concurrency or len(items) or 1)
    bar = Progress(len(items), progress)
    timings = [RequestTiming(sent_s=math.nan) for _ in items]
    clock0 = time.perf_counter()

    async def one(i: int, client) -> None:
        await asyncio.sleep(max(0.0, clock0 + offsets[i] - time.perf_counter()))
        async with gate:
            timings[i].sent_s = time.perf_counter() - clock0
            body = {"model": model, "prompt": items[i].prompt, "max_tokens": items[i].output_len,
                    "stream": True, "ignore_eos": True, "temperature": 0.0,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            try:
                await _stream_one(client, url, body, timings[i], clock0)
            except httpx.HTTPError as exc:
                timings[i].error = type(exc).__name__
        bar.step()

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        tasks = [asyncio.create_task(one(i, client)) for i in range(len(items))]
        _, pending = await asyncio.wait(tasks, timeout=max_duration_s)
        for task in pending:  # the wall-clock cap: whatever is left is counted, not awaited
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for i, task in enumerate(tasks):
        if task in pending:
            timings[i].error = "cancelled_at_cap"
    ends = [t.chunks[-1][0] for t in timings if t.chunks]
    starts = [t.sent_s for t in timings if not math.isnan(t.sent_s)]
    duration = (max(ends) - min(starts)) if ends and starts else time.perf_counter() - clock0
    return timings, duration


def _check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(
            f"bench serve only targets a server on this machine (loopback), not {host!r}"
        )


def _server_info(url: str, api_key: str | None) -> dict:
    """The served model card (name, max_model_len); {} when the server has none."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(f"{url}/v1/models", headers=headers, timeout=10.0).json()
        return data["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError):
        return {}


def load_items(args: argparse.Namespace, max_model_len: int) -> list[Item]:
    rng = np.random.default_rng(args.seed)
    if args.dataset == "fixed":
        return fixed_items(args.num_prompts, rng, args.input_len, args.output_len, args.vocab_size)
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise SystemExit("--dataset sharegpt needs --dataset-path FILE")
        path, n = args.dataset_path, args.num_prompts
        return sharegpt_items(path, n, rng, max_model_len, args.tokenizer)
    return longtail_items(args.num_prompts, rng, max_model_len, args.vocab_size)


def benchmark(args: argparse.Namespace) -> dict:
    """One run per request rate (``--request-rates`` sweeps), the same requests each time.
    Returns the JSON result; ``result["_timings"]`` holds each run's raw timings."""
    url = args.url.rstrip("/")
    _check_loopback(url)
    info = _server_info(url, args.api_key)
    model = args.model or info.get("id") or "default"
    max_model_len = args.max_model_len or info.get("max_model_len") or 2048
    if args.tokenizer:
        from ..workers.tokenizer import Tokenizer

        args.vocab_size = Tokenizer(args.tokenizer).vocab_size
    items = load_items(args, max_model_len)
    rates = [float(r) for r in (args.request_rates or str(args.request_rate)).split(",")]
    result = {"runs": [], "_timings": []}
    for rate in rates:
        rng = np.random.default_rng(args.seed)
        timings, duration = asyncio.run(run_load(
            url, items, arrival_offsets(len(items), rate, args.burstiness, rng), model=model,
            api_key=args.api_key, max_concurrency=args.max_concurrency,
            max_duration_s=args.max_duration, progress=not args.no_progress))  # fmt: skip
        summary = summarize(timings, duration, slo_ttft_s=args.slo_ttft, slo_itl_s=args.slo_itl)
        summary["request_rate"] = rate if math.isfinite(rate) else "inf"  # JSON has no inf
        summary["num_prompt_tokens"] = sum(i.prompt_len for i in items)
        summary["errors"] = dict(Counter(t.error for t in timings if t.error))
        result["runs"].append(summary)
        result["_timings"].append(timings)
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    config.update(model=model, max_model_len=max_model_len, request_rate=str(args.request_rate))
    return {"config": config, **result}


def render(result: dict) -> str:
    lines = []
    for s in result["runs"]:
        lines.append(f"rate {s['request_rate']} req/s: {s['num_completed']}/{s['num_requests']} ok, "
                     f"{s['request_throughput_req_s']} req/s, {s['throughput_tok_s']} tok/s, "
                     f"goodput {s['goodput_req_s']} req/s, errors {s['errors'] or 'none'}")  # fmt: skip
        for name in ("ttft", "itl", "tpot", "e2e"):
            q = "  ".join(f"p{p} {s[f'{name}_p{p}_s']}" for p in (50, 90, 99))
            lines.append(f"  {name.upper():5} {q}  (s)")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    result = benchmark(args)
    timings = result.pop("_timings")
    # Files first: a reader that stops reading stdout early must not lose them.
    write_json(result, args.json)
    if args.png:
        from .plots import loadgen_plot

        loadgen_plot(result, timings, args.png)
    print(render(result))
    print(json.dumps(result, indent=2))


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``serve`` to the ``iterserve bench`` sub-commands."""
    p = subparsers.add_parser("serve", help="open-loop streaming load against a running server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback)")
    p.add_argument("--model", help="model name to send (default: the server's)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    p.add_argument("--dataset", choices=DATASETS, default="longtail")
    p.add_argument("--dataset-path", help="ShareGPT-format JSON file (--dataset sharegpt)")
    p.add_argument("--tokenizer", help="tokenizer directory: exact ShareGPT lengths, prompt ids")
    p.add_argument("--input-len", type=int, default=128, help="--dataset fixed prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="--dataset fixed output tokens")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s (inf: at once)")
    p.add_argument("--request-rates", help="comma-separated rates: a sweep, one run each")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    p.add_argument("--slo-ttft", type=float, help="goodput: TTFT limit in seconds")
    p.add_argument("--slo-itl", type=float, help="goodput: limit on each request's p99 ITL, s")
    p.add_argument("--max-duration", type=float, default=600.0, help="wall-clock cap per run, s")
    p.add_argument("--max-model-len", type=int, help="default: the server's /v1/models card")
    p.add_argument("--vocab-size", type=int, default=256, help="synthetic prompt ids are in [3, N)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the result to this file")
    p.add_argument("--png", help="latency CDFs, or throughput/p99 vs rate for a sweep")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=main)
    return p
