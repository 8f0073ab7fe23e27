"""``iterserve serve``: the OpenAI-compatible server on a local Ray instance.

``run_server`` starts Ray on this machine, sized by the machine itself (no
dashboard; Ray listens on loopback, see docs/reliability.md), starts Serve's
HTTP proxy on ``host:port``, deploys :func:`~iterserve.cluster.serve.app.build_app`
at ``/``, waits until every engine replica has loaded its model, prints the URL
and serves until Ctrl-C or SIGTERM. Then it drains: every engine replica stops
taking requests (new ones get 503 with Retry-After) and finishes those it has,
streams included, for up to ``drain_timeout_s`` (30 s by default); then it
stops Serve and Ray within seconds.

Ray starts its ranks at nice 15 by default; the Ray started here runs them at
nice 0 (``worker_niceness``), like any server process, so a client or a batch
job at nice 0 on the same machine does not take the CPU from the model ranks.
For a Ray cluster you run yourself, use ``serve run deploy/serve-config.example.yaml``
(and ``RAY_worker_niceness=0 ray start ...`` for the same priority).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .flags import (
    APP,
    CLI,
    ENGINE,
    SERVE_DEFAULTS,
    Flag,
    FlagError,
    FlagParser,
    Setting,
    command_parser,
    from_file,
    merged,
    split,
    startup_line,
    vllm_answers,
)

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
    config: dict[str, Any] | None = None,
    ready_timeout_s: float = 900.0,
    block: bool = True,
    executor: ExecutorFactory | None = None,
    **settings: Any,
) -> str:
    """Serves the OpenAI-compatible API; returns the base URL.

    model: checkpoint directory (``None``: the bundled demo model).
    config_file: YAML or JSON file of EngineConfig keys (policy, max_num_seqs, ...).
    host, port: where the ingress answers HTTP (``0.0.0.0`` to accept remote clients).
    config: EngineConfig keys that override the file's.
    ready_timeout_s: how long to wait for the engines to load before giving up.
    block: serve until Ctrl-C / SIGTERM, then shut down (``False``: return at once,
        leaving Serve running; the caller shuts it down).
    executor: what the ranks run instead of the model (code only: :mod:`~iterserve.cluster.ranks.executors`).
    settings: the ingress's, :class:`~iterserve.cluster.serve.app.ServeArgs` fields
        (``num_engine_replicas``, ``api_key_env``, ``model_name``, ``tool_call_parser``, ...).
    """
    from .app import ServeArgs

    engine = load_config_file(config_file) if config_file else {}
    engine.update(config or {})
    args = ServeArgs(model=model, config=engine, http_host=host, http_port=port, **settings)
    return start(args, ready_timeout_s=ready_timeout_s, block=block, executor=executor)


def start(
    args,
    *,
    ready_timeout_s: float = 900.0,
    block: bool = True,
    executor: ExecutorFactory | None = None,
    quiet: bool = False,
) -> str:
    """Starts Ray (unless running), Serve and the app of ``args`` (a ServeArgs);
    returns the base URL once every engine replica has loaded. With ``block``,
    serves until Ctrl-C or SIGTERM, then drains and stops everything. ``quiet``:
    Ray's and Serve's own logs stay in Ray's log files (what ``iterserve serve``
    does unless ``--log-level debug``)."""
    from .app import build_application

    host, port = args.http_host, args.http_port
    name = _check_before_starting(args)
    if executor is None:
        _check_model_files(args)

    import ray
    from ray import serve

    # With ``block``, from here on a SIGTERM unwinds like Ctrl-C, start-up included,
    # so Ray's processes never outlive this one.
    previous = signal.signal(signal.SIGTERM, _interrupt) if block else None
    started_ray = False
    serving = False
    url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
    try:
        if not ray.is_initialized():
            _start_ray(quiet)
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
        serving = True
        print(f"iterserve: serving {name} at {url}/v1{_dtype_note(infos)}", flush=True)
        if block:
            threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        if block:
            if serving:
                print("iterserve: draining, then shutting down", flush=True)
            drain_s = args.engine_config().drain_timeout_s if serving else None
            _shutdown(stop_ray=started_ray, drain_timeout_s=drain_s)
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


def _check_model_files(args) -> None:
    """Refuses a checkpoint the ranks would refuse (its config, its weights' index),
    and sampling defaults every request would be refused for, before anything starts."""
    from ...workers.checkpoint import load_checkpoint
    from ...workers.quant import resolve
    from .model_files import sampling_defaults

    engine = args.engine_config()
    ckpt = load_checkpoint(engine.model_path)
    ckpt.close()
    resolve(engine.quantization, ckpt.quantization)  # the quantization knob against the checkpoint
    sampling_defaults(args.generation_config, engine.model_path, args.override_generation_config)


def _dtype_note(infos: list[dict]) -> str:
    """ ", in bfloat16 (auto: why) on amx" from the engines' start-up answers: the
    dtype, why, and the instruction set the CPU kernels use; then ", weights ..." where
    the weights are quantized."""
    chosen = {(i["dtype"], i["dtype_reason"], i.get("isa"), i.get("quantization"))
              for i in infos if "dtype" in i}  # fmt: skip
    return "".join(
        f", in {dtype} ({reason})"
        + (f" on {isa}" if isa else "")
        + (f", weights {quantization}" if quantization else "")
        for dtype, reason, isa, quantization in sorted(chosen, key=str)
    )


def _start_ray(quiet: bool = False) -> None:
    """A fresh single-node Ray, bound to loopback: nothing of it is reachable from
    other machines; only the HTTP server listens on the given host and port.
    ``quiet``: the Ray processes' logs stay in Ray's session logs
    (/tmp/ray/session_latest/logs) instead of printing here too."""
    import ray

    if quiet:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    ray.init(
        address="local",
        include_dashboard=False,
        logging_level="ERROR" if quiet else "WARNING",
        log_to_driver=not quiet,
        _node_ip_address="127.0.0.1",
        _system_config={"worker_niceness": WORKER_NICENESS},
    )


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _shutdown(stop_ray: bool, drain_timeout_s: float | None = 0.0) -> None:
    """Drains every engine replica (bounded by ``drain_timeout_s``: they finish
    what they have while the ingress answers new requests 503; None: a start that
    failed, nothing to drain), stops Serve (bounded: its controller may wait out
    timeouts), then the Ray this process started, which takes every Ray process
    with it. Signals wait meanwhile: a second SIGTERM or Ctrl-C must not cut this
    short."""
    import ray
    from ray import serve

    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if drain_timeout_s is None and stop_ray:
            # A start that failed: the Ray this process started takes Serve with it
            # (stopping Serve first only prints its controller's pending calls failing).
            ray.shutdown()
            return
        if drain_timeout_s is not None:
            _drain_engines(drain_timeout_s)
        _stop_serve(serve)
        if stop_ray:
            ray.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_serve(serve) -> None:
    """Stops Serve within SERVE_SHUTDOWN_S. Asynchronously, so that what is left of it
    when time runs out is cancelled: Ray must not be called once it is shut down
    (its core worker then ends the process with exit code 1)."""
    import asyncio

    async def bounded() -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(serve.shutdown_async(), SERVE_SHUTDOWN_S)

    asyncio.run(bounded())


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


# -- the command ----------------------------------------------------------------------------

API_KEY_ENV = "ITERSERVE_API_KEY"  # where --api-key's key travels to the ingress
logger = logging.getLogger("iterserve.serve")


@dataclass
class ServePlan:
    """What a command line asks for, checked, before anything starts."""

    args: Any  # ServeArgs
    settings: dict[str, Setting]  # what the flags and the config file set, and from where
    notes: list[str]  # one log line per vLLM flag accepted with nothing to do
    api_key: str | None = None
    log_level: str = "info"


def serve_parser(prog: str = "iterserve serve") -> tuple[FlagParser, list[Flag]]:
    parser, flags = command_parser(
        prog,
        f"{prog} [MODEL] [flags]",
        "The OpenAI-compatible server. Its flags are vLLM's where vLLM has the\n"
        "setting, in vLLM's help groups; each names its config key [in brackets].",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="a checkpoint directory, or a Hugging Face hub id in the local cache "
        "(default: the demo model)",
    )
    return parser, flags


def serve_plan(argv: list[str], prog: str = "iterserve serve") -> ServePlan:
    """The plan of a command line (raises FlagError with the sentence that refuses
    it; a malformed flag exits as argparse does, with one line)."""
    parser, flags = serve_parser(prog)
    return plan_from(parser.parse_args(argv), flags)


def plan_from(ns: argparse.Namespace, flags: list[Flag]) -> ServePlan:
    from pydantic import ValidationError

    from .app import ServeArgs
    from .model_files import resolve_model

    given = dict(getattr(ns, "given", {}))
    if ns.model_tag is not None:
        if "model" in given and given["model"][0] != ns.model_tag:
            raise FlagError(
                f"the model is given twice: {ns.model_tag} and --model {given['model'][0]}"
            )
        given["model"] = (ns.model_tag, "MODEL")
    file_settings: dict[str, Setting] = {}
    file_vllm: list = []
    if "config" in given:
        file_settings, file_vllm = from_file(_read_config(given["config"][0]), flags)
    notes = vllm_answers(file_vllm + getattr(ns, "vllm_flags", []))
    settings = merged(file_settings, given)
    parts = split(settings, flags)
    engine, app, cli = parts[ENGINE], parts[APP], parts[CLI]
    if engine.get("model") is not None:
        name = str(engine["model"])
        engine["model"], from_hub = resolve_model(name, cli.get("download_dir"))
        if from_hub and "model_name" not in app:
            app["model_name"] = name  # as vLLM serves it: under its hub id
    api_key = cli.get("api_key")
    if api_key is not None:
        if app.get("api_key_env"):
            raise FlagError("--api-key and --api-key-env both name the key; give one")
        app["api_key_env"] = API_KEY_ENV
    if cli.get("enable_auto_tool_choice") and not app.get("tool_call_parser"):
        raise FlagError("--enable-auto-tool-choice requires --tool-call-parser")
    app = {**SERVE_DEFAULTS, **app}
    try:
        args = ServeArgs(config=engine, **app)
        args.engine_config()
    except ValidationError as exc:
        first = exc.errors()[0]
        key = str(first["loc"][0]) if first["loc"] else ""
        message = first["msg"].removeprefix("Value error, ")
        raise FlagError(_named(key, message, settings)) from None
    except ValueError as exc:
        message = str(exc)
        key = next((k for k in settings if re.search(rf"\b{k}\b", message)), "")
        raise FlagError(_named(key, message, settings)) from None
    return ServePlan(args, settings, notes, api_key, cli.get("log_level", "info"))


def _read_config(path: str) -> dict[str, Any]:
    try:
        return load_config_file(path)
    except OSError as exc:
        raise FlagError(f"--config {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # JSON's errors are ValueErrors
        raise FlagError(f"--config {path}: {exc}") from None
    except Exception as exc:  # YAML's
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise FlagError(f"--config {path}: not YAML{where}: {problem}") from None


def _named(key: str, message: str, settings: dict[str, Setting]) -> str:
    """``message`` about config key ``key``, led by where the value came from."""
    setting = settings.get(key)
    if setting is None:
        return message
    source = setting.source
    if source.startswith("-"):
        source = f"{source} {_shown(setting.value)}"
    return f"{source}: {message}"


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def main(argv: list[str] | None = None, prog: str = "iterserve serve") -> int:
    """``iterserve serve``: the exit code (2: refused before anything started, the
    command line or what it names; 1: a start that failed)."""
    from . import startup

    parser, flags = serve_parser(prog)
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        plan = plan_from(ns, flags)
    except ValueError as exc:  # FlagError, a model not found, a bad chat template, ...
        return startup.refuse(prog, str(exc))
    debug = plan.log_level == "debug"
    _log_to_terminal(plan.log_level)
    for note in plan.notes:
        logger.info(note)
    line = startup_line(plan.settings)
    if line:
        print(f"iterserve: settings: {line}", flush=True)
    if plan.api_key is not None:
        # The Ray started next gives its processes this environment: the key reaches
        # the ingress without being written into any config.
        os.environ[API_KEY_ENV] = plan.api_key
    try:  # what can be refused before anything starts (start checks it again, cheaply)
        _check_before_starting(plan.args)
        _check_model_files(plan.args)
    except Exception as exc:  # a checkpoint the loader refuses, a port in use, too few CPUs
        return startup.refuse(prog, startup.one_line(exc), exc if debug else None)
    try:
        start(plan.args, block=True, quiet=not debug)
    except Exception as exc:
        return startup.fail(prog, exc, debug=debug)
    return 0


def _log_to_terminal(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root = logging.getLogger("iterserve")
    root.addHandler(handler)
    root.setLevel(level.upper())


if __name__ == "__main__":
    sys.exit(main())
