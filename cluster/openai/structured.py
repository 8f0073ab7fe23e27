"""Structured outputs: which grammar a request's fields ask for, and the check
that it compiles, before anything reaches an engine.

A request constrains its output in one of these ways (two at once are refused):

=====================================  =========================================
field                                  grammar
=====================================  =========================================
``response_format: json_object``       any JSON object
``response_format: json_schema``       its ``json_schema.schema`` (any JSON without one)
``guided_json``, ``structured_outputs.json``  the JSON schema (an object or its text)
``guided_regex``, ``structured_outputs.regex``  the regular expression
``guided_choice``, ``structured_outputs.choice``  exactly one of the strings
``guided_grammar``, ``structured_outputs.grammar``  xgrammar's EBNF (``::=``), else Lark
``structured_outputs.json_object``     any JSON object
``tool_choice: required`` / a function  the tools' call schema (:mod:`chat`)
=====================================  =========================================

The grammar is compiled here for the served vocabulary, in a child process
(``python -m iterserve.workers.grammar``) that is killed when a compile takes
longer than ``COMPILE_TIMEOUT_S``: what does not compile, or not in time, or a
schema keyword xgrammar would not enforce, is a 400 naming the field, and
never reaches a scheduler. Verdicts are cached by spec, in the child and here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import select
import subprocess
import sys
import threading
from collections import OrderedDict
from typing import Any

from ...scheduler.sampling import MAX_GRAMMAR_BYTES, StructuredOutput
from .errors import RETRY_AFTER_UNAVAILABLE_S, APIError, bad_request

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 5.0  # a grammar slower to compile is refused: the ranks compile it too
START_TIMEOUT_S = 120.0  # the checking process's start (it imports torch and xgrammar)
_ANY_OBJECT = '{"type": "object"}'
_VERDICTS = 1024  # specs whose verdict is remembered


def _json_schema(value: Any, param: str) -> str:
    """A JSON schema sent as an object or as its text, as compact text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{param}: not valid JSON: {exc}", param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{param}: a JSON schema must be an object", param)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _ebnf_literal(text: str) -> str:
    """``text`` as a string literal of xgrammar's EBNF."""
    escaped = []
    for ch in text:
        if ch in '"\\':
            escaped.append("\\" + ch)
        elif ord(ch) < 0x20 or ch == "\x7f":
            escaped.append(f"\\u{ord(ch):04x}")  # \xNN would swallow a hex digit after it
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'


def _choice(value: Any, param: str) -> StructuredOutput:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise bad_request(f"{param}: must be a non-empty list of strings", param)
    return StructuredOutput("ebnf", "root ::= " + " | ".join(map(_ebnf_literal, value)))


def _grammar(value: Any, param: str) -> StructuredOutput:
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"{param}: must be a non-empty grammar", param)
    return StructuredOutput("ebnf" if "::=" in value else "lark", value)


def _regex(value: Any, param: str) -> StructuredOutput:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param}: must be a non-empty regular expression", param)
    if "\x00" in value:
        raise bad_request(f"{param}: must not hold a NUL character", param)
    return StructuredOutput("regex", value)


def _from_structured_outputs(value) -> list[tuple[str, StructuredOutput]]:
    found = []
    if value.structural_tag is not None:
        param = "structured_outputs.structural_tag"
        raise bad_request(f"{param}: structural tags are not supported by this server", param)
    if value.json_ is not None:
        spec = _json_schema(value.json_, "structured_outputs.json")
        found.append(("structured_outputs.json", StructuredOutput("json", spec)))
    if value.regex is not None:
        found.append(("structured_outputs.regex", _regex(value.regex, "structured_outputs.regex")))
    if value.choice is not None:
        param = "structured_outputs.choice"
        found.append((param, _choice(value.choice, param)))
    if value.grammar is not None:
        param = "structured_outputs.grammar"
        found.append((param, _grammar(value.grammar, param)))
    if value.json_object:
        found.append(("structured_outputs.json_object", StructuredOutput("json", _ANY_OBJECT)))
    return found


def requested(request, tool_schema: dict | None = None) -> tuple[str, StructuredOutput] | None:
    """The field that constrains the output and its grammar, or None. ``tool_schema``:
    the call schema that ``tool_choice`` asks for."""
    found: list[tuple[str, StructuredOutput]] = []
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(("response_format", StructuredOutput("json", _ANY_OBJECT)))
    elif response_format is not None and response_format.type == "json_schema":
        form = response_format.json_schema
        if form is None:
            param = "response_format.json_schema"
            raise bad_request(f"{param}: required when type is json_schema", param)
        schema = {} if form.json_schema is None else form.json_schema
        spec = _json_schema(schema, "response_format.json_schema.schema")
        found.append(("response_format", StructuredOutput("json", spec)))
    if request.guided_json is not None:
        spec = _json_schema(request.guided_json, "guided_json")
        found.append(("guided_json", StructuredOutput("json", spec)))
    if request.guided_regex is not None:
        found.append(("guided_regex", _regex(request.guided_regex, "guided_regex")))
    if request.guided_choice is not None:
        found.append(("guided_choice", _choice(request.guided_choice, "guided_choice")))
    if request.guided_grammar is not None:
        found.append(("guided_grammar", _grammar(request.guided_grammar, "guided_grammar")))
    if request.structured_outputs is not None:
        found += _from_structured_outputs(request.structured_outputs)
    if tool_schema is not None:
        spec = json.dumps(tool_schema, ensure_ascii=False, separators=(",", ":"))
        found.append(("tool_choice", StructuredOutput("json", spec)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(dict.fromkeys(name for name, _ in found))
        raise bad_request(
            f"{found[1][0]}: only one way of constraining the output may be used, got {names}",
            found[1][0],
        )
    param, spec = found[0]
    if len(spec.spec.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise bad_request(f"{param}: longer than {MAX_GRAMMAR_BYTES} bytes", param)
    _check_combinations(request, param)
    return param, spec


def _check_combinations(request, param: str) -> None:
    """Fields a grammar cannot honour beside it: the grammar decides where the
    output ends, and which tokens it may hold."""
    clashes = {
        "ignore_eos": request.ignore_eos,
        "min_tokens": bool(request.min_tokens),
        "allowed_token_ids": request.allowed_token_ids is not None,
        "bad_words": bool(request.bad_words),
    }
    for name, used in clashes.items():
        if used:
            raise bad_request(
                f"{name}: cannot be combined with structured outputs ({param}): the grammar "
                "decides where the output ends and which tokens it may hold",
                name,
            )


class GrammarValidator:
    """Checks that grammars compile for the served vocabulary, in a child process
    started on the first check and replaced whenever a compile overruns."""

    def __init__(self, tokenizer_path: str, timeout_s: float = COMPILE_TIMEOUT_S):
        self.tokenizer_path = str(tokenizer_path)
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one check at a time through the one child
        self._verdicts: OrderedDict[StructuredOutput, str] = OrderedDict()

    async def check(self, param: str, spec: StructuredOutput, vocab_size: int) -> None:
        """400 naming ``param`` when ``spec`` does not compile (in time)."""
        verdict = self._verdicts.get(spec)
        if verdict is None:
            verdict = await asyncio.to_thread(self._ask, spec, vocab_size)
            self._verdicts[spec] = verdict
            while len(self._verdicts) > _VERDICTS:
                self._verdicts.popitem(last=False)
        if verdict:
            raise bad_request(f"{param}: {verdict}", param)

    def _start(self, vocab_size: int) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "iterserve.workers.grammar", self.tokenizer_path,
             str(vocab_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8",
        )  # fmt: skip
        if self._read(proc, START_TIMEOUT_S) is None:
            proc.kill()
            proc.wait()
            raise APIError(
                503,
                "structured outputs are unavailable: the grammar checking process did not "
                "start (see the server log)",
                code="grammar_checker_unavailable",
                headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)},
            )
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen, timeout_s: float) -> dict | None:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def _ask(self, spec: StructuredOutput, vocab_size: int) -> str:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start(vocab_size)
            proc = self._proc
            assert proc.stdin is not None
            try:
                proc.stdin.write(json.dumps({"kind": spec.kind, "spec": spec.spec}) + "\n")
                proc.stdin.flush()
                answer = self._read(proc, self.timeout_s)
            except (OSError, ValueError):
                answer = None
            if answer is not None:
                return answer["error"]
            died = proc.poll()
            proc.kill()  # overran, or died: the next check starts a fresh one
            proc.wait()
            self._proc = None
            if died is not None:
                logger.error("the grammar checking process died (exit %s) on a grammar", died)
                return "the grammar compiler failed on it"
            logger.warning("a grammar took longer than %g s to compile; refused", self.timeout_s)
            return f"the grammar takes longer than {self.timeout_s:g} s to compile; simplify it"

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc = None
