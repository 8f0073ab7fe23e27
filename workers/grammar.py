"""Structured outputs: grammars compiled by xgrammar, a matcher per sequence, and
the token bitmask the sampler applies.

A grammar's spec (:class:`~iterserve.scheduler.sampling.StructuredOutput`) is a
JSON schema, a regular expression or a grammar (xgrammar's EBNF, or Lark). The
ingress compiles it once to refuse what xgrammar cannot compile
(:class:`GrammarChecker`); every rank compiles it again, off the step, when the
sequence arrives (:class:`Grammars`), cached by spec.

The matcher of a sequence lives on the rank and advances with every token the
rank samples, so a rank fills step N+1's mask from its own token of step N
(scheduling ahead needs nothing from the scheduler), and with tensor parallelism
every rank, sampling the same tokens, holds the same state and applies the same
mask. A :class:`~iterserve.scheduler.messages.NewSequence` carries the tokens
produced so far: after a preemption, or on a restarted worker group, the matcher
is rebuilt from them, so it never depends on anything a rank lost.

The step's bitmask has a row per sampled sequence and one bit per token
(``1``: allowed), 32 to an int32; rows without a grammar are all ones and are
left out of the kernel's rows::

    bitmask [num_sampled_rows, ceil(vocab / 32)] int32
    token t of row i is allowed  <=>  (bitmask[i, t // 32] >> (t % 32)) & 1
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import xgrammar as xgr

from ..scheduler.sampling import SamplingParams, StructuredOutput
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_VOCAB_TYPES = {
    "byte_level": xgr.VocabType.BYTE_LEVEL,
    "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
    "raw": xgr.VocabType.RAW,
}
# xgrammar prefixes its messages with a time and a source location.
_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")
CACHE_SIZE = 64  # compiled grammars kept per process


class GrammarError(ValueError):
    """A spec xgrammar cannot compile; the message says why."""


def tokenizer_info(
    tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of ``tokenizer``, masks ``vocab_size`` wide (the model's
    logits; ids past the tokenizer's vocabulary are never allowed)."""
    vocab = tokenizer.grammar_vocabulary()
    tokens = vocab.tokens[:vocab_size]
    return xgr.TokenizerInfo(
        tokens,
        _VOCAB_TYPES[vocab.kind],
        vocab_size=vocab_size,
        stop_token_ids=sorted(stop_token_ids) or None,
        add_prefix_space=vocab.add_prefix_space,
    )


def _compile(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
    if spec.kind == "json":
        try:
            found = unenforced(json.loads(spec.spec))
        except (ValueError, RecursionError):
            found = None  # xgrammar's own parse says what is wrong with it
        if found is not None:
            raise GrammarError(f"the schema uses {found}, which xgrammar does not enforce")
    try:
        if spec.kind == "json":
            # Separators are fixed (", " and ": "): a model cannot stall in whitespace
            # between tokens, and the output reads as json.dumps writes it.
            return compiler.compile_json_schema(spec.spec, any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "ebnf":
            return compiler.compile_grammar(spec.spec)
        return compiler.compile_lark(spec.spec)
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError, its own types
        message = _LOG_PREFIX.sub("", str(exc)).strip().splitlines()
        reason = message[0] if message else type(exc).__name__
        raise GrammarError(f"the grammar does not compile: {reason}") from None


# String formats xgrammar writes (and so enforces); others it would let pass.
STRING_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})  # fmt: skip
# Keywords whose value is a map of names to schemas, a list of schemas, or a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "additionalItems",
                  "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
# Accepted by xgrammar's converter but not enforced: an output could break them.
_UNENFORCED = ("contains", "minContains", "maxContains", "not", "if", "then", "else",
               "dependentRequired", "dependentSchemas")  # fmt: skip


def unenforced(schema: object) -> str | None:
    """The first thing a JSON schema asks for that xgrammar would accept and not
    enforce (so an output could break the schema), or None."""
    if not isinstance(schema, dict):
        return None
    found = next((key for key in _UNENFORCED if key in schema), None)
    if found is None and schema.get("uniqueItems") is True:
        found = "uniqueItems"
    if found is None and isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        found = "allOf with more than one schema"
    types = schema.get("type", "string")
    if found is None and "string" in (types if isinstance(types, list) else [types]):
        if isinstance(schema.get("format"), str) and schema["format"] not in STRING_FORMATS:
            found = f"format {schema['format']!r}"
        elif ("pattern" in schema or "format" in schema) and (
            "minLength" in schema or "maxLength" in schema
        ):
            found = "a pattern or format together with minLength or maxLength"
    if found is not None:
        return found
    children: list = [schema.get(key) for key in _SCHEMA_VALUES]
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += schema[key].values()
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += schema[key]
    return next((f for f in map(unenforced, children) if f is not None), None)


class _Cache:
    """Compiled grammars by spec, the least recently used dropped first."""

    def __init__(self, size: int = CACHE_SIZE):
        self.size = size
        self._items: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, spec: StructuredOutput):
        with self._lock:
            value = self._items.get(spec)
            if value is not None:
                self._items.move_to_end(spec)
            return value

    def put(self, spec: StructuredOutput, value) -> None:
        with self._lock:
            self._items[spec] = value
            self._items.move_to_end(spec)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


class GrammarChecker:
    """The ingress's check: does a spec compile for this vocabulary? The verdicts
    are cached by spec; the compiled grammars are not kept (the ranks compile
    their own)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_threads: int = 1):
        info = tokenizer_info(tokenizer, vocab_size, sorted(tokenizer.eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._verdicts = _Cache(1024)

    def check(self, spec: StructuredOutput) -> None:
        """Raises GrammarError naming the problem when ``spec`` does not compile."""
        verdict = self._verdicts.get(spec)
        if verdict is None:
            try:
                _compile(self._compiler, spec)
                verdict = ""
            except GrammarError as exc:
                verdict = str(exc)
            self._verdicts.put(spec, verdict)
        if verdict:
            raise GrammarError(verdict)


@dataclass
class GrammarMask:
    """One step's grammar constraints over the sampler's ``n`` rows: ``bitmask[i]``
    applies to row ``i`` for each ``i`` in ``rows``; the other rows are all ones."""

    bitmask: torch.Tensor  # [n, ceil(vocab / 32)] int32, on the host
    rows: list[int]


class SeqGrammar:
    """One sequence's grammar state, kept on its ``SeqState.grammar``: the grammar
    being compiled, then its matcher. ``waiting``: the token after which the
    grammar starts (``StructuredOutput.start_after``, a reasoning block's end),
    until the sequence samples it; None once it applies."""

    def __init__(self, compiled: Future, output_ids: list[int], waiting: int | None = None):
        self.compiled = compiled
        self.replay = output_ids  # tokens to accept once the grammar is compiled
        self.matcher: xgr.GrammarMatcher | None = None
        self.broken = False  # it refused a token, or its grammar failed to compile
        self.waiting = waiting


class GrammarRow(Protocol):
    """What :class:`Grammars` reads and writes of a sequence (``SeqState``)."""

    seq_id: int
    params: SamplingParams
    output_token_ids: list[int]
    grammar: SeqGrammar | None


class Grammars:
    """A rank's grammars: compiled in the background (shared by spec), one matcher
    per sequence, kept on the sequence (``SeqState.grammar``), so it leaves with it.

    ``tokenizer_path`` holds the checkpoint's tokenizer (read when the first
    grammar arrives); ``stop_token_ids`` end a grammar (the model's EOS ids).
    """

    def __init__(
        self,
        tokenizer_path: str | Path | None,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_threads: int = 2,
    ):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_threads = max_threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._futures = _Cache()
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)

    def _compile_async(self, spec: StructuredOutput) -> Future:
        future = self._futures.get(spec)
        if future is None or (future.done() and future.exception() is not None):
            if self._compiler is None:
                if self.tokenizer_path is None:
                    raise GrammarError("this runner has no tokenizer to compile grammars with")
                tokenizer = Tokenizer(self.tokenizer_path)
                info = tokenizer_info(tokenizer, self.vocab_size, self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            assert self._pool is not None
            future = self._pool.submit(_compile, self._compiler, spec)
            self._futures.put(spec, future)
        return future

    def add(self, seq: GrammarRow) -> None:
        """Starts a sequence's grammar (its ``params.structured_output``); the tokens
        it produced before a preemption or a restart are accepted once it is compiled."""
        spec = seq.params.structured_output
        assert spec is not None
        try:  # one compile per grammar, wherever it starts
            future = self._compile_async(StructuredOutput(spec.kind, spec.spec))
        except GrammarError as exc:
            future = Future()
            future.set_exception(exc)
        output, waiting = list(seq.output_token_ids), spec.start_after
        if waiting is not None and waiting in output:  # it started before a preemption
            output, waiting = output[output.index(waiting) + 1 :], None
        seq.grammar = SeqGrammar(future, output, waiting)

    def _matcher(self, seq: GrammarRow) -> xgr.GrammarMatcher | None:
        state = seq.grammar
        assert state is not None
        if state.matcher is None and not state.broken:
            try:
                compiled = state.compiled.result()  # compiled meanwhile, normally
            except Exception as exc:
                logger.error("sequence %d: its grammar did not compile: %s", seq.seq_id, exc)
                state.broken = True
                return None
            state.matcher = xgr.GrammarMatcher(
                compiled,
                override_stop_tokens=self.stop_token_ids or None,
                terminate_without_stop_token=not self.stop_token_ids,
            )
            for token_id in state.replay:
                if not state.matcher.accept_token(token_id):
                    state.broken = True
                    break
            state.replay = []
        return None if state.broken else state.matcher

    def fill(self, rows: Sequence[GrammarRow | None]) -> GrammarMask | None:
        """The mask of one step's sampler rows (``rows[i]`` owns row ``i``; None or a
        sequence without a grammar: all allowed), or None when no row has a grammar."""
        found = []
        for i, seq in enumerate(rows):
            if seq is not None and seq.grammar is not None and seq.grammar.waiting is None:
                matcher = self._matcher(seq)
                # A broken one is ended after this sample; an ended one never samples
                # again (the runner ends its sequence with the grammar).
                if matcher is not None and not matcher.is_terminated():
                    found.append((i, seq, matcher))
        if not found:
            return None
        n = len(rows)
        if self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 2 * self._bitmask.shape[0], 8),
                                                       self.vocab_size)  # fmt: skip
        bitmask = self._bitmask[:n]
        bitmask.fill_(-1)  # all ones: rows without a grammar allow every token
        masked = []
        for i, seq, matcher in found:
            try:
                matcher.fill_next_token_bitmask(bitmask, i)
                masked.append(i)
            except Exception:  # xgrammar's own check failed: this sequence alone ends
                logger.exception("sequence %d: its grammar cannot give a next token", seq.seq_id)
                seq.grammar.broken = True
                bitmask[i] = -1
        return GrammarMask(bitmask, masked) if masked else None

    @staticmethod
    def done(seq: GrammarRow) -> bool:
        """Whether a sequence's grammar has ended (it accepted a stop token)."""
        state = seq.grammar
        return state is not None and state.matcher is not None and state.matcher.is_terminated()

    def accept(self, seq: GrammarRow, token_id: int) -> bool:
        """Advances a sequence's matcher; False when its grammar refuses the token
        (or was broken before), and the sequence cannot go on."""
        state = seq.grammar
        if state is None:
            return True
        if state.waiting is not None:  # unconstrained until its start token
            if token_id == state.waiting:
                state.waiting = None
            return True
        matcher = self._matcher(seq)
        if matcher is None or not matcher.accept_token(token_id):
            state.broken = True
            return False
        return True


def apply_token_bitmask(logits: torch.Tensor, mask: GrammarMask, bitmask: torch.Tensor) -> None:
    """Sets ``logits[i, t]`` to -inf for every row ``i`` of ``mask.rows`` wherever bit
    ``t`` of ``bitmask[i]`` (``mask.bitmask`` on the logits' device) is 0: xgrammar's
    kernel for the device (C++ on the CPU, Triton on CUDA), one call for the step."""
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=mask.rows)


def serve_checks(tokenizer_path: str, vocab_size: int) -> None:
    """Answers checks on stdin and stdout, one JSON line each way: a request
    ``{"kind", "spec"}`` gets ``{"error": ""}`` when the spec compiles, else the
    reason. The first line out is ``{"ready": true}``, once xgrammar is loaded."""
    import sys

    checker = GrammarChecker(Tokenizer(tokenizer_path), vocab_size)
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            checker.check(StructuredOutput(request["kind"], request["spec"]))
            error = ""
        except GrammarError as exc:
            error = str(exc)
        except Exception as exc:  # a malformed line or spec: its own answer, never an exit
            error = f"{type(exc).__name__}: {exc}"
        out.write(json.dumps({"error": error}) + "\n")
        out.flush()


if __name__ == "__main__":
    import sys

    serve_checks(sys.argv[1], int(sys.argv[2]))
