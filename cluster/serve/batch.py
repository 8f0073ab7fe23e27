"""``iterserve run-batch``: an OpenAI batch file through the offline engine, as vLLM's.

::

    iterserve run-batch -i in.jsonl -o out.jsonl --model MODEL [serve's engine flags]

Each line of the input is one request, as OpenAI's Batch API writes them::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

``url`` is ``/v1/chat/completions``, ``/v1/completions`` or ``/v1/embeddings``
(the last with ``--runner pooling``, which in turn refuses the other two by
name, as the server does). Each is answered by the same code that answers the HTTP
route (:class:`~iterserve.cluster.openai.serving.OpenAIServing`), over one
engine started in this process (:class:`~iterserve.cluster.engine.api.AsyncEngine`),
with ``2 × max_num_seqs`` requests in flight. The output has one line per input
line, in the input's order, written as soon as every line before it is::

    {"id": "batch_req_…", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "…", "body": {<the route's answer>}},
     "error": null}

A line that cannot be answered (not JSON, no ``custom_id``, an unknown ``url``,
``stream: true``, a body the route refuses, an engine failure) gets its answer
all the same: ``response.status_code`` is the HTTP status the route would
answer (400, 404, 503, ...), ``response.body`` null, and ``error`` the error
object (``message``, ``type``, ``param``, ``code``). Blank lines are skipped. A
progress bar goes to stderr; the command exits 0 once every line is written
(lines that failed included), 1 when the engine could not start or the output
could not be written, 2 on a bad command line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

from .flags import FlagParser, command_parser

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
IN_FLIGHT_PER_SLOT = 2  # requests in flight per engine slot (vLLM's run-batch: the same)


class BatchEngineClient:
    """What :class:`OpenAIServing` needs of the engines, over one in-process
    :class:`AsyncEngine`."""

    def __init__(self, engine):
        self.engine = engine

    async def open(self, request_id, prompt_token_ids, params, priority):
        return await self.engine.connection.open(
            request_id, list(prompt_token_ids), params, priority
        )

    async def info(self) -> dict:
        return self.engine.info

    async def stats(self) -> list[dict]:
        return [await self.engine.stats()]

    async def health(self) -> list[dict]:
        healthy, message = await self.engine.health()
        return [{"healthy": healthy, "ready": healthy, "message": message}]


def _answer(custom_id: Any, status: int, request_id: str, body=None, error=None) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


def _refused(custom_id: Any, status: int, request_id: str, message: str, code: str,
             param: str | None = None) -> dict:  # fmt: skip
    from ..openai.errors import error_body

    error = error_body(status, message, param, code)["error"]
    return _answer(custom_id, status, request_id, error=error)


async def answer_line(serving, text: str, number: int) -> dict:
    """The output line of input line ``number``: never raises."""
    from ..openai.errors import APIError

    request_id = f"batch-{uuid.uuid4().hex[:24]}"
    try:
        line = json.loads(text)
        if not isinstance(line, dict):
            raise ValueError("a line must be a JSON object")
    except ValueError as exc:
        return _refused(None, 400, request_id, f"line {number}: {exc}", "invalid_json")
    custom_id, url, body = line.get("custom_id"), line.get("url"), line.get("body")
    handler = _handler(serving, url)
    if not isinstance(custom_id, str) or not custom_id:
        message = f"line {number}: custom_id must be a non-empty string"
        return _refused(custom_id, 400, request_id, message, "invalid_line", "custom_id")
    if line.get("method", "POST") != "POST":
        message = f"line {number}: method must be POST"
        return _refused(custom_id, 400, request_id, message, "invalid_line", "method")
    if handler is None:
        served = ", ".join(r for r in ROUTES if _handler(serving, r) is not None)
        what = f"{url} is not served by this engine" if url in ROUTES else f"unknown url {url!r}"
        message = f"line {number}: {what}; batch lines go to {served}"
        return _refused(custom_id, 404, request_id, message, "unsupported_url", "url")
    if not isinstance(body, dict):
        message = f"line {number}: body must be a JSON object"
        return _refused(custom_id, 400, request_id, message, "invalid_line", "body")
    if body.get("stream"):
        message = "stream: batch lines are answered whole; send stream false"
        return _refused(custom_id, 400, request_id, message, "invalid_value", "stream")
    try:
        response = await handler(json.dumps(body).encode(), request_id)
        return _answer(custom_id, response.status_code, request_id, json.loads(response.body))
    except APIError as exc:
        return _answer(custom_id, exc.status, request_id, error=exc.body(None)["error"])
    except Exception as exc:  # a bug: this line fails, the batch goes on
        message = f"{type(exc).__name__}: {exc}"
        return _refused(custom_id, 500, request_id, message, "internal_error")


def _handler(serving, url: Any) -> Callable[[bytes, str], Awaitable] | None:
    names = {
        "/v1/chat/completions": "chat",
        "/v1/completions": "completions",
        "/v1/embeddings": "embeddings",
    }
    return getattr(serving, names[url], None) if url in names else None


class Progress:
    """``Running batch: 40/100 [00:12<00:18, 3.3 req/s]`` on stderr: redrawn in place on
    a terminal, a line every few seconds elsewhere (a log file stays readable)."""

    def __init__(self, total: int, out: TextIO | None = None, every_s: float = 5.0):
        self.total, self.done, self.every_s = total, 0, every_s
        self.out = out or sys.stderr
        self.started = self.shown = time.monotonic()
        self.tty = self.out.isatty()

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.tty or now - self.shown >= self.every_s or self.done == self.total:
            self.shown = now
            self.out.write(("\r" if self.tty else "") + self.line(now) + ("" if self.tty else "\n"))
            self.out.flush()

    def line(self, now: float) -> str:
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        return (
            f"Running batch: {self.done}/{self.total} "
            f"[{_clock(elapsed)}<{_clock(left)}, {rate:.1f} req/s]"
        )

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


async def run_batch(serving, lines: list[str], out: TextIO, in_flight: int) -> int:
    """Answers every line, writing the answers in order as they become writable;
    returns how many lines were answered with an error."""
    answers: dict[int, dict] = {}
    next_out = 0
    failed = 0
    progress = Progress(len(lines))
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int, text: str) -> None:
        nonlocal next_out, failed
        async with gate:
            answers[i] = await answer_line(serving, text, i + 1)
        failed += answers[i]["error"] is not None
        progress.step()
        while next_out in answers:  # in order: everything before it is written
            out.write(json.dumps(answers.pop(next_out), ensure_ascii=False) + "\n")
            next_out += 1
        out.flush()

    try:
        await asyncio.gather(*(one(i, text) for i, text in enumerate(lines)))
    finally:
        progress.close()
    return failed


def read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line.strip()]


async def _run(plan, input_path: str, output_path: str, executor=None) -> int:
    from ..engine.api import AsyncEngine
    from . import resources
    from .ingress import openai_serving

    lines = read_lines(input_path)
    config = resources.resolve(plan.args.engine_config())
    async with AsyncEngine(config, executor) as engine:
        serving = openai_serving(
            BatchEngineClient(engine), config, plan.args, {"policy": config.scheduler.policy}
        )
        in_flight = IN_FLIGHT_PER_SLOT * config.scheduler.max_num_seqs
        with open(output_path, "w", encoding="utf-8") as out:
            failed = await run_batch(serving, lines, out, in_flight)
    return failed


def batch_parser(prog: str = "iterserve run-batch") -> tuple[FlagParser, list]:
    parser, flags = command_parser(
        prog,
        f"{prog} -i INPUT -o OUTPUT [--model MODEL] [flags]",
        "Answers an OpenAI batch file (JSONL) through the offline engine, as vLLM's "
        "run-batch;\nthe engine takes `iterserve serve`'s flags.",
    )
    parser.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL)")
    parser.add_argument("-o", "--output-file", required=True, help="where the answers go (JSONL)")
    parser.add_argument(
        "--output-tmp-dir", help="accepted for vLLM's sake: the output is written in place"
    )
    parser.set_defaults(model_tag=None)
    return parser, flags


def main(argv: list[str] | None = None, prog: str = "iterserve run-batch", executor=None) -> int:
    """``iterserve run-batch``: the exit code (see the module docstring).
    ``executor``: what the ranks run instead of the model (code only)."""
    import logging

    import ray

    from . import startup
    from .cli import _log_to_terminal, plan_from

    parser, flags = batch_parser(prog)
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        plan = plan_from(ns, flags)
        read_lines(ns.input_file)  # an unreadable input is refused before the engine starts
    except (ValueError, OSError) as exc:
        return startup.refuse(prog, str(exc))
    _log_to_terminal(plan.log_level)
    log = logging.getLogger("iterserve.run_batch")
    for note in plan.notes:
        log.info(note)
    quiet = plan.log_level != "debug"
    started_ray = not ray.is_initialized()
    try:
        if started_ray:
            ray.init(
                address="local", include_dashboard=False, log_to_driver=not quiet,
                logging_level="ERROR" if quiet else "WARNING",
            )  # fmt: skip
        failed = asyncio.run(_run(plan, ns.input_file, ns.output_file, executor))
    except Exception as exc:
        return startup.fail(prog, exc, debug=not quiet)
    finally:
        if started_ray:
            ray.shutdown()
    total = len(read_lines(ns.input_file))
    print(
        f"iterserve: run-batch: {total} lines answered in {ns.output_file} "
        f"({total - failed} ok, {failed} with an error)",
        file=sys.stderr,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
