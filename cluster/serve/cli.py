"""``iterserve serve``: the OpenAI-compatible server on a local Ray instance.

``run_server`` starts Ray on this machine, sized by the machine itself (no
dashboard; Ray listens on loopback, see docs/reliability.md), starts Serve's
HTTP proxy on ``host:port``, deploys :func:`~iterserve.cluster.serve.app.build_app`
at ``/``, waits until every engine replica has loaded its model, prints the URL
and serves until Ctrl-C or SIGTERM. Then it drains: every engine replica stops
taking requests (new ones get 503 with Retry-After) and finishes those it has,
streams included, for up to ``drain_timeout_s`` (30 s by default); then it
stops Serve and Ray within seconds.

Ray starts its workers at nice 15 by default; the Ray started here runs them at
nice 0 (``worker_niceness``), like any server process, so a client or a batch
job at nice 0 on the same machine does not take the CPU from the model ranks.
For a Ray cluster you run yourself, use ``serve run deploy/serve-config.example.yaml``
(and ``RAY_worker_niceness=0 ray start ...`` for the same priority).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..openai.tool_parsers import TOOL_CALL_PARSERS
from .routing import ROUTINGS

if TYPE_CHECKING:
    from ..ranks.executors import ExecutorFactory

APP_NAME = "iterserve"
WORKER_NICENESS = 0  # Ray's default is 15: see the module docstring
SERVE_SHUTDOWN_S = 5.0  # what Serve gets to stop its deployments before Ray goes
DRAIN_MARGIN_S = 10.0  # beyond drain_timeout_s: the last outputs reach their clients


def load_config_file(path: str | Path) -> dict[str, Any]:
    """An engine config (EngineConfig keys) from a YAML or JSON file."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the engine config must be a mapping of EngineConfig keys")
    return data


def run_server(
    model: str | None = None,
    config_file: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    num_engine_replicas: int = 1,
    api_key_env: str | None = None,
    max_body_bytes: int = 8 << 20,
    model_name: str | None = None,
    request_timeout_s: float | None = 600.0,
    config: dict[str, Any] | None = None,
    ready_timeout_s: float = 900.0,
    block: bool = True,
    strict_fields: bool = False,
    tool_call_parser: str | None = None,
    cors_allowed_origins: list[str] | None = None,
    cors_allow_credentials: bool = False,
    metrics_require_api_key: bool = True,
    routing: str = "prefix",
    executor: ExecutorFactory | None = None,
) -> str:
    """Serves the OpenAI-compatible API; returns the base URL.

    model: checkpoint directory (``None``: the bundled demo model).
    config_file: YAML or JSON file of EngineConfig keys (policy, max_num_seqs, ...).
    host, port: where the ingress answers HTTP (``0.0.0.0`` to accept remote clients).
    num_engine_replicas: data-parallel engine copies behind the one ingress.
    api_key_env: name of the environment variable that holds the API key; unset: no auth.
    max_body_bytes: largest request body; larger ones get 413.
    model_name: the name clients send as ``model`` (default: the checkpoint's directory name).
    request_timeout_s: requests still running after this long are aborted (504).
    config: EngineConfig keys that override the file's.
    ready_timeout_s: how long to wait for the engines to load before giving up.
    block: serve until Ctrl-C / SIGTERM, then shut down (``False``: return at once,
        leaving Serve running; the caller shuts it down).
    strict_fields: refuse request fields the server does not know (default: ignore them).
    tool_call_parser: how tool calls are read from the output (``hermes``, ``llama3_json``).
    cors_allowed_origins, cors_allow_credentials: origins browsers may call from.
    metrics_require_api_key: whether /metrics needs the API key too.
    routing: how the ingress spreads requests over engine replicas: ``prefix``
        (to the one likely to hold the prompt's prefix, load as the bound) or ``load``.
    executor: what the ranks run instead of the model (code only: :mod:`~iterserve.cluster.ranks.executors`).
    """
    from .app import ServeArgs, build_application

    engine = load_config_file(config_file) if config_file else {}
    engine.update(config or {})
    args = ServeArgs(
        model=model,
        config=engine,
        num_engine_replicas=num_engine_replicas,
        api_key_env=api_key_env,
        max_body_bytes=max_body_bytes,
        model_name=model_name,
        request_timeout_s=request_timeout_s,
        strict_fields=strict_fields,
        tool_call_parser=tool_call_parser,
        cors_allowed_origins=cors_allowed_origins or [],
        cors_allow_credentials=cors_allow_credentials,
        metrics_require_api_key=metrics_require_api_key,
        routing=routing,
        http_host=host,
        http_port=port,
    )
    name = _check_before_starting(args)

    import ray
    from ray import serve

    # With ``block``, from here on a SIGTERM unwinds like Ctrl-C, start-up included,
    # so Ray's processes never outlive this one.
    previous = signal.signal(signal.SIGTERM, _interrupt) if block else None
    started_ray = False
    url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
    try:
        if not ray.is_initialized():
            _start_ray()
            started_ray = True
            if block:
                # Ray's core replaces the handler with one that logs, then aborts
                # the process three seconds later, whatever shutdown is doing.
                signal.signal(signal.SIGTERM, _interrupt)
        # The ingress answers HTTP on host:port itself: no proxy in the token path.
        serve.start(proxy_location="Disabled")
        serve.run(build_application(args, executor), name=APP_NAME, route_prefix="/")
        engines = serve.get_deployment_handle("EngineServer", APP_NAME)
        infos = engines.broadcast("info").results(timeout_s=ready_timeout_s)
        print(f"iterserve: serving {name} at {url}/v1{_dtype_note(infos)}", flush=True)
        if block:
            threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        if block:
            print("iterserve: draining, then shutting down", flush=True)
            _shutdown(stop_ray=started_ray, drain_timeout_s=args.engine_config().drain_timeout_s)
            signal.signal(signal.SIGTERM, previous)
    return url


def _check_before_starting(args) -> str:
    """Refuses a bad config, one this machine cannot place, or a port another
    server holds, before anything starts; returns the served model's name."""
    import ray

    from . import ports, resources

    replicas = args.initial_engine_replicas
    checked = resources.resolve(args.engine_config(), num_engine_replicas=replicas)
    resources.check_fits(checked, num_engine_replicas=replicas, ingress_cpus=args.ingress_cpus)
    # A Ray this command starts is new: whatever holds the port then is another server.
    ours = ports.app_key(APP_NAME) if ray.is_initialized() else None
    ports.check(args.http_host, args.http_port, ours)
    return args.served_model_name(checked)


def _dtype_note(infos: list[dict]) -> str:
    """ ", in bfloat16 (auto: why)" from the engines' start-up answers."""
    chosen = {(i["dtype"], i["dtype_reason"]) for i in infos if "dtype" in i}
    return "".join(f", in {dtype} ({reason})" for dtype, reason in sorted(chosen))


def _start_ray() -> None:
    """A fresh single-node Ray, bound to loopback: nothing of it is reachable from
    other machines; only the HTTP server listens on the given host and port."""
    import ray

    ray.init(
        address="local",
        include_dashboard=False,
        logging_level="WARNING",
        _node_ip_address="127.0.0.1",
        _system_config={"worker_niceness": WORKER_NICENESS},
    )


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _shutdown(stop_ray: bool, drain_timeout_s: float = 0.0) -> None:
    """Drains every engine replica (bounded by ``drain_timeout_s``: they finish
    what they have while the ingress answers new requests 503), stops Serve
    (bounded: its controller may wait out timeouts), then the Ray this process
    started, which takes every Ray process with it. Signals wait meanwhile: a
    second SIGTERM or Ctrl-C must not cut this short."""
    import ray
    from ray import serve

    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _drain_engines(drain_timeout_s)
        stopper = threading.Thread(target=serve.shutdown, name="serve-shutdown", daemon=True)
        stopper.start()
        stopper.join(SERVE_SHUTDOWN_S)
        if stop_ray:
            ray.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _drain_engines(timeout_s: float) -> None:
    from ray import serve

    try:
        engines = serve.get_deployment_handle("EngineServer", APP_NAME)
        drained = engines.broadcast("drain").results(timeout_s=timeout_s + DRAIN_MARGIN_S)
    except Exception as exc:  # nothing deployed yet, or Serve already gone
        print(f"iterserve: draining skipped: {type(exc).__name__}: {exc}", flush=True)
        return
    finished = sum(d.get("finished", 0) for d in drained if isinstance(d, dict))
    cut = sum(d.get("cut", 0) for d in drained if isinstance(d, dict))
    print(
        f"iterserve: drained: {finished} requests finished, {cut} cut at the deadline", flush=True
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``serve`` subcommand's options; ``serve_from_args`` runs them."""
    parser.add_argument("--model", help="checkpoint directory (default: the demo model)")
    parser.add_argument("--config", help="engine config file, YAML or JSON (EngineConfig keys)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    parser.add_argument(
        "--engine-replicas", type=int, default=1, help="data-parallel engine copies (default 1)"
    )
    parser.add_argument(
        "--api-key-env", help="environment variable holding the API key (default: no auth)"
    )
    parser.add_argument("--served-model-name", help="name clients use as `model`")
    parser.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse request fields the server does not know (default: accept and ignore)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        help="how tool calls are read from the model's output (needed for tool_choice auto)",
    )
    parser.add_argument(
        "--cors-allowed-origins",
        type=_origins,
        default=[],
        help="comma-separated origins browsers may call from, or * (default: no CORS)",
    )
    parser.add_argument(
        "--cors-allow-credentials", action="store_true", help="let browsers send credentials"
    )
    parser.add_argument(
        "--metrics-without-api-key",
        dest="metrics_require_api_key",
        action="store_false",
        help="serve /metrics without the API key (for scrapers that have none)",
    )
    parser.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="prefix",
        help="how requests spread over engine replicas: to the one likely to hold the "
        "prompt's prefix, load as the bound (prefix, the default), or by load alone",
    )
    from ..lora import add_lora_arguments

    add_lora_arguments(parser)
    parser.add_argument(
        "--speculative-config",
        type=_json_object,
        help="speculative decoding, as vLLM takes it: JSON such as "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'',
    )
    parser.set_defaults(func=serve_from_args)
    return parser


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _origins(text: str) -> list[str]:
    return [origin.strip() for origin in text.split(",") if origin.strip()]


def serve_from_args(args: argparse.Namespace) -> None:
    run_server(
        model=args.model,
        config_file=args.config,
        host=args.host,
        port=args.port,
        num_engine_replicas=args.engine_replicas,
        api_key_env=args.api_key_env,
        model_name=args.served_model_name,
        strict_fields=args.strict_fields,
        tool_call_parser=args.tool_call_parser,
        cors_allowed_origins=args.cors_allowed_origins,
        cors_allow_credentials=args.cors_allow_credentials,
        metrics_require_api_key=args.metrics_require_api_key,
        routing=args.routing,
        config=engine_config_from_args(args),
    )


def engine_config_from_args(args: argparse.Namespace) -> dict:
    """The engine config keys the flags set (only those given)."""
    from ..lora import lora_config_from_args

    config = lora_config_from_args(args)
    if getattr(args, "speculative_config", None) is not None:
        config["speculative_config"] = args.speculative_config
    return config


def main(argv: list[str] | None = None) -> int:
    parser = add_serve_arguments(argparse.ArgumentParser(prog="iterserve serve"))
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
