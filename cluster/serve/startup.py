"""A command that cannot start ends with one sentence.

``iterserve serve`` and ``iterserve run-batch`` check what they can before
anything starts (flags, the config file, the model's files); whatever still
fails on the way up (a rank that cannot load, a port in use) surfaces from
Ray wrapped in task errors whose text holds whole tracebacks. Either way the
terminal gets one line, ``<command>: <the reason>``, and a non-zero exit code;
the full traceback goes to a log file the line names (and to the terminal too
with ``--log-level debug``).
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path

EXIT_REFUSED = 2  # a flag, the config file or the model refused before anything started
EXIT_FAILED = 1  # the start itself failed

# Ray's prefix of an error raised in a task or actor: "ray::RankActor.load() (pid=1, ip=…)".
_RAY_FRAME = re.compile(r"^ray::\S+ \(pid=\d+, ip=[^)]*\)(, actor_id=\w+)?(, repr=.*)?$")
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Failure|Exit))(?:: (.*))?$")


def log_dir() -> Path:
    return Path(os.environ.get("ITERSERVE_LOG_DIR") or Path(tempfile.gettempdir()) / "iterserve")


def root_cause(exc: BaseException) -> BaseException:
    """The innermost error: through Ray's wrappers (``cause``) and ``raise … from``."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None) or exc.__cause__
        if not isinstance(inner, BaseException):
            break
        exc = inner
    return exc


def one_line(exc: BaseException) -> str:
    """The reason ``exc`` gives, as one line: its message, or, where the message is
    a traceback's text (Ray's), the last error line in it."""
    exc = root_cause(exc)
    text = str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc).strip()
    text = text or type(exc).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1:
        errors = [m for m in map(_ERROR_LINE.match, lines) if m and m.group(2)]
        if errors:
            return _sentence(errors[-1].group(2))
        lines = [line for line in lines if not _RAY_FRAME.match(line)]
    return _sentence(" ".join(lines) if lines else type(exc).__name__)


def _sentence(text: str) -> str:
    return " ".join(text.split())


def refuse(command: str, reason: str, exc: BaseException | None = None) -> int:
    """One line for something refused before anything started: the reason is all
    there is (``exc``: its traceback goes first, as ``--log-level debug`` asks)."""
    if exc is not None:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(f"{command}: {reason}", file=sys.stderr, flush=True)
    return EXIT_REFUSED


def fail(command: str, exc: BaseException, debug: bool = False) -> int:
    """One line for a start that failed; the traceback goes to a log file (and to the
    terminal with ``debug``). Returns the exit code."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    where = ""
    try:
        folder = log_dir()
        folder.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = folder / f"{command.split()[-1]}-{stamp}-{os.getpid()}.log"
        path.write_text(text, encoding="utf-8")
        where = f" (traceback: {path})"
    except OSError:  # no log file: the traceback goes to the terminal instead
        debug = True
    if debug:
        print(text, file=sys.stderr, end="", flush=True)
    print(f"{command}: {one_line(exc)}{where}", file=sys.stderr, flush=True)
    return EXIT_FAILED
