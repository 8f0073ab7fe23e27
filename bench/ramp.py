"""Autoscaling measured: ``iterserve bench ramp`` drives idle → saturating → idle.

One run on a Ray of its own (sized by this machine): the Serve app with engine
autoscaling on (``min_replicas`` 1 to ``max_replicas`` 3, the policy of
:mod:`iterserve.cluster.serve.autoscaling`), the ingress answering HTTP itself.
The engines run the fake model (``step_sleep_s`` per step stands in for a
forward; its ranks reserve a tenth of a CPU each, so three engine copies fit a
two-core machine without telling Ray it has more): what is measured is the
cluster's behaviour, not the model's speed.

Closed-loop clients (each streams a request of ``max_tokens`` tokens, then the
next) go from none to ``peak`` over the ramp, hold ``peak``, then stop; the run
ends once the replicas are back at the minimum. Every half second it samples
Serve's running engine replicas and the requests waiting in the engines. It
writes a JSON of the timeline, every request and the summary, and a PNG of
replicas, queue depth and TTFT over time. The summary's figures: failed
requests (the goal is none), the most replicas and the last, and the TTFT p99
of the requests that arrived during the ramp over that of the last half of the
hold (the steady state at the final size), a ratio from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from dataclasses import asdict, dataclass, field

from .report import percentile, write_json

APP = "ramp"
SAMPLE_S = 0.5
MIN_REPLICAS, MAX_REPLICAS = 1, 3
MAX_NUM_SEQS = 8


@dataclass(frozen=True)
class Shape:
    idle_s: float  # before any load
    ramp_s: float  # clients from 0 to peak
    hold_s: float  # peak clients
    cooldown_cap_s: float  # after the load: at most this long for the scale-down
    peak: int  # clients at the top of the ramp
    max_tokens: int
    step_sleep_s: float
    upscale_delay_s: float
    downscale_delay_s: float


SHAPES = {
    "full": Shape(10, 30, 40, 120, 3 * MAX_NUM_SEQS, 32, 0.02, 2.0, 10.0),
    "small": Shape(3, 8, 16, 60, 3 * MAX_NUM_SEQS, 24, 0.02, 1.0, 4.0),
}


@dataclass
class Request:
    start_s: float  # since the run's start
    phase: str
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class Run:
    shape: Shape
    t0: float = field(default_factory=time.monotonic)
    requests: list[Request] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    clients: int = 0
    phase: str = "idle"

    def now(self) -> float:
        return time.monotonic() - self.t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(shape: Shape) -> str:
    """Ray, Serve and the app; returns the ingress's URL once the engine answers."""
    import ray
    from ray import serve

    from ..cluster.serve.app import ServeArgs, build_application
    from ..models import DEMO_MODEL_PATH
    from ..scheduler import FakeModel
    from ..workers.tokenizer import Tokenizer

    ray.init(
        address="local",
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
        _system_config={"worker_niceness": 0},
    )
    serve.start(proxy_location="Disabled")
    port = _free_port()
    args = ServeArgs(
        model=str(DEMO_MODEL_PATH),
        config={
            "max_num_seqs": MAX_NUM_SEQS,
            "num_kv_blocks": 512,
            "block_size": 16,
            "max_num_batched_tokens": 256,
            "max_model_len": 512,
            "num_cpus_per_worker": 0.1,
        },
        autoscaling={
            "min_replicas": MIN_REPLICAS,
            "max_replicas": MAX_REPLICAS,
            "target_ttft_s": 1.0,
            "upscale_delay_s": shape.upscale_delay_s,
            "downscale_delay_s": shape.downscale_delay_s,
            "look_back_period_s": 3.0,
            "metrics_interval_s": 0.5,
        },
        routing="load",
        http_port=port,
    )
    vocab = Tokenizer(DEMO_MODEL_PATH).vocab_size
    model = FakeModel(vocab_size=vocab, max_model_len=512, step_sleep_s=shape.step_sleep_s)
    serve.run(build_application(args, model), name=APP, route_prefix="/")
    serve.get_deployment_handle("EngineServer", APP).broadcast("info").results(timeout_s=300)
    return f"http://127.0.0.1:{port}"


def _running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None:
        return 0
    states = app.deployments["EngineServer"].replica_states
    return int(states.get("RUNNING", 0))


async def _one(client, run: Run) -> None:
    body = {"model": "demo", "prompt": "hello", "max_tokens": run.shape.max_tokens,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    req = Request(run.now(), run.phase)
    run.requests.append(req)
    start = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                req.error = f"{r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    req.error = event["error"]["message"]
                    return
                if event.get("usage"):
                    req.tokens = event["usage"]["completion_tokens"]
                elif req.ttft_s is None:
                    req.ttft_s = time.monotonic() - start
        if req.tokens != run.shape.max_tokens:
            req.error = f"{req.tokens} of {run.shape.max_tokens} tokens"
    except Exception as exc:  # a cut connection is a failed request too
        req.error = f"{type(exc).__name__}: {exc}"
    finally:
        req.e2e_s = time.monotonic() - start


async def _client(client, run: Run, index: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        if index < run.clients:
            await _one(client, run)
        else:
            await asyncio.sleep(0.1)


async def _sample(client, run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        waiting = running = None
        per_replica: list | str = []
        try:
            stats = (await client.get("/v1/stats", timeout=10)).json()
            ready = [r for r in stats["replicas"] if r.get("ready")]
            waiting = sum(r.get("num_waiting", 0) for r in ready)
            running = sum(r.get("num_running", 0) for r in ready)
            per_replica = [(r.get("num_running"), r.get("num_waiting")) for r in ready]
        except Exception as exc:  # a sample lost is a gap in the figure
            per_replica = f"{type(exc).__name__}: {exc}"
        replicas = await asyncio.to_thread(_running_replicas)
        run.samples.append({"t_s": round(run.now(), 2), "phase": run.phase, "clients": run.clients,
                            "replicas": replicas, "num_waiting": waiting, "num_running": running,
                            "per_replica": per_replica})  # fmt: skip
        await asyncio.sleep(SAMPLE_S)


async def _drive(url: str, run: Run) -> None:
    import httpx

    shape = run.shape
    limits = httpx.Limits(max_connections=shape.peak + 8)
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        tasks = [asyncio.create_task(_client(client, run, i, stop)) for i in range(shape.peak)]
        sampler = asyncio.create_task(_sample(client, run, stop))
        await asyncio.sleep(shape.idle_s)
        run.phase = "ramp"
        ramp_start = run.now()
        while (elapsed := run.now() - ramp_start) < shape.ramp_s:
            run.clients = min(shape.peak, 1 + int(shape.peak * elapsed / shape.ramp_s))
            await asyncio.sleep(0.1)
        run.phase, run.clients = "hold", shape.peak
        await asyncio.sleep(shape.hold_s / 2)
        run.phase = "steady"  # the last half of the hold: the final size's steady state
        await asyncio.sleep(shape.hold_s / 2)
        run.phase, run.clients = "cooldown", 0
        deadline = run.now() + shape.cooldown_cap_s
        await asyncio.sleep(2 * SAMPLE_S)
        while run.now() < deadline:
            if run.samples and run.samples[-1]["replicas"] == MIN_REPLICAS:
                break
            await asyncio.sleep(SAMPLE_S)
        await asyncio.sleep(2 * SAMPLE_S)
        stop.set()
        await asyncio.gather(*tasks, sampler)


def summarize(run: Run) -> dict:
    done = [r for r in run.requests if r.error is None]
    by_phase = {p: [r.ttft_s for r in done if r.phase == p and r.ttft_s is not None]
                for p in ("ramp", "hold", "steady")}  # fmt: skip
    ramp = by_phase["ramp"] + by_phase["hold"]
    ramp_p99, steady_p99 = percentile(ramp, 99), percentile(by_phase["steady"], 99)
    replicas = [s["replicas"] for s in run.samples]
    scaled_out = next((s["t_s"] for s in run.samples if s["replicas"] > MIN_REPLICAS), None)
    cooldown = [s for s in run.samples if s["phase"] == "cooldown"]
    back = next((s["t_s"] for s in cooldown if s["replicas"] == MIN_REPLICAS), None)
    return {
        "requests": len(run.requests),
        "failed_requests": len(run.requests) - len(done),
        "errors": sorted({r.error for r in run.requests if r.error})[:5],
        "min_replicas": MIN_REPLICAS,
        "max_replicas_allowed": MAX_REPLICAS,
        "max_replicas_reached": max(replicas, default=0),
        "final_replicas": replicas[-1] if replicas else 0,
        "max_num_waiting": max((s["num_waiting"] or 0 for s in run.samples), default=0),
        "first_scale_out_s": scaled_out,
        "back_to_min_s": back,
        "ttft_ramp_p99_s": ramp_p99,
        "ttft_steady_p99_s": steady_p99,
        "ttft_ramp_over_steady_p99": (
            round(ramp_p99 / steady_p99, 2) if ramp_p99 and steady_p99 else None
        ),
    }


def plot(result: dict, path: str) -> None:
    from .plots import _pyplot

    plt = _pyplot()
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    samples = result["samples"]
    ts = [s["t_s"] for s in samples]
    top.step(ts, [s["replicas"] for s in samples], where="post", label="engine replicas")
    top.step(ts, [s["clients"] / MAX_NUM_SEQS for s in samples], where="post", linestyle=":",
             label=f"clients / max_num_seqs ({MAX_NUM_SEQS})")  # fmt: skip
    top.set_ylabel("replicas")
    top.legend(loc="upper right", fontsize=8)
    nan = float("nan")  # a lost sample: a gap
    mid.plot(ts, [nan if s["num_waiting"] is None else s["num_waiting"] for s in samples],
             label="waiting")  # fmt: skip
    mid.plot(ts, [nan if s["num_running"] is None else s["num_running"] for s in samples],
             label="running")  # fmt: skip
    mid.set_ylabel("requests in engines")
    mid.legend(loc="upper right", fontsize=8)
    done = [r for r in result["requests_detail"] if r["ttft_s"] is not None]
    low.scatter([r["start_s"] for r in done], [r["ttft_s"] for r in done], s=4)
    failed = [r for r in result["requests_detail"] if r["error"]]
    if failed:
        low.scatter([r["start_s"] for r in failed], [0] * len(failed), s=12, c="red",
                    label="failed")  # fmt: skip
        low.legend(loc="upper right", fontsize=8)
    low.set_ylabel("TTFT (s)")
    low.set_xlabel("seconds since start")
    summary = result["summary"]
    fig.suptitle(
        f"bench ramp: {summary['requests']} requests, {summary['failed_requests']} failed; "
        f"TTFT p99 ramp/steady {summary['ttft_ramp_over_steady_p99']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(scale: str = "full", json_path: str | None = None, png_path: str | None = None) -> dict:
    shape = SHAPES[scale]
    url = _start(shape)
    try:
        state = Run(shape)
        asyncio.run(_drive(url, state))
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    result = {
        "bench": "ramp",
        "scale": scale,
        "shape": asdict(shape),
        "summary": summarize(state),
        "samples": state.samples,
        "requests_detail": [asdict(r) for r in state.requests],
    }
    write_json(result, json_path)
    if png_path:
        plot(result, png_path)
    return result


def main(args: argparse.Namespace) -> None:
    result = run(args.scale, args.json, args.png)
    print(json.dumps(result["summary"], indent=2))


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``ramp`` to the ``iterserve bench`` sub-commands."""
    p = subparsers.add_parser(
        "ramp", help="idle → saturating → idle with engine autoscaling: replicas, queue, TTFT"
    )
    p.add_argument("--scale", choices=sorted(SHAPES), default="full",
                   help="small: a shorter run of the same shape")  # fmt: skip
    p.add_argument("--json", help="write the timeline, the requests and the summary here")
    p.add_argument("--png", help="write the figure (replicas, queue depth, TTFT) here")
    p.set_defaults(func=main)
    return p
