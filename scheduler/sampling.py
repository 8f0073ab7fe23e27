"""Sampling parameters and their validation.

Every check raises :class:`SamplingParamsError` whose message names the field and
the allowed range, so the HTTP layer can return it verbatim as a 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 1024  # biased tokens per request
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_BAD_WORDS = 256  # token sequences, each at most MAX_BAD_WORD_LEN tokens
MAX_BAD_WORD_LEN = 512
# A grammar's spec (a JSON schema, a regex, an EBNF grammar) is the longest text a
# step plan carries; the codec's string limit is this size.
MAX_GRAMMAR_BYTES = 1 << 20
# What a structured output's spec is: a JSON schema (as JSON text), a regular
# expression, or a grammar in xgrammar's EBNF or in Lark's syntax.
GRAMMAR_KINDS = ("json", "regex", "ebnf", "lark")


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range. ``field`` names the parameter."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _check_number(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(name, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise SamplingParamsError(name, f"must be finite, got {value}")
    below = value <= lo if lo_open else value < lo
    if below or value > hi:
        left = "(" if lo_open else "["
        raise SamplingParamsError(name, f"must be in {left}{lo}, {hi}], got {value}")


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SamplingParamsError(name, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise SamplingParamsError(name, f"must be in [{lo}, {hi}], got {value}")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """The grammar a sequence's output must follow: ``kind`` (one of
    ``GRAMMAR_KINDS``) says how to read ``spec``. The ingress checks that it
    compiles; the ranks compile it again and mask every token it forbids.
    ``start_after``: a token id (a reasoning block's end); the grammar applies to
    the output after its first occurrence, nothing before it is constrained.
    None: from the first token."""

    kind: str
    spec: str
    start_after: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise SamplingParamsError(
                "structured_output", f"kind must be one of {', '.join(GRAMMAR_KINDS)}"
            )
        if not isinstance(self.spec, str) or not self.spec:
            raise SamplingParamsError("structured_output", "spec must be a non-empty string")
        if len(self.spec.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
            raise SamplingParamsError(
                "structured_output", f"spec is longer than {MAX_GRAMMAR_BYTES} bytes"
            )
        if self.start_after is not None:
            _check_int("structured_output", self.start_after, 0, (1 << 31) - 1)


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` and
    ``min_p == 0`` disable those filters. ``logprobs`` is the number of top
    alternatives to return per token (``None``: no logprobs at all).
    Stop *strings* are not here: the ingress matches them after detokenizing.

    vLLM's engine-side extensions, all applied on the ranks: ``logit_bias``
    (``(token_id, bias)`` pairs added to the logits), ``allowed_token_ids``
    (``None``: every token), ``bad_words`` (token sequences whose last token is
    banned where the output ends in the rest), ``prompt_logprobs`` (alternatives
    per prompt token; ``None``: none) and ``structured_output`` (a grammar).
    ``max_tokens == 0`` computes the prompt and finishes (reason ``length``)
    without sampling: what an echo of the prompt's logprobs asks for.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, 0.0, 2.0)
        for name in _FLOAT_FIELDS:  # 0 and 0.0 are the same setting; store floats
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        _check_number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, 0, 1 << 30)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        _check_int("max_tokens", self.max_tokens, 0, 1 << 30)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_int("n", self.n, 1, 1 << 10)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, (1 << 31) - 1)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos", "must be a boolean")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, 1 << 10)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, 1 << 10)
        self._check_extensions()

    def _check_extensions(self) -> None:
        # Lists become tuples (a dict crossing from the ingress holds lists), and a
        # structured output sent as a dict becomes the dataclass.
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError(
                "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"
            )
        bias = []
        for pair in self.logit_bias:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise SamplingParamsError("logit_bias", "must be (token_id, bias) pairs")
            token_id, value = pair
            _check_int("logit_bias", token_id, 0, (1 << 31) - 1)
            _check_number("logit_bias", value, *LOGIT_BIAS_RANGE)
            bias.append((token_id, float(value)))
        object.__setattr__(self, "logit_bias", tuple(bias))
        if self.allowed_token_ids is not None:
            allowed = tuple(self.allowed_token_ids)
            object.__setattr__(self, "allowed_token_ids", allowed)
            if not 1 <= len(allowed) <= MAX_ALLOWED_TOKEN_IDS:
                raise SamplingParamsError(
                    "allowed_token_ids",
                    f"must hold 1 to {MAX_ALLOWED_TOKEN_IDS} ids, got {len(allowed)}",
                )
            for token_id in allowed:
                _check_int("allowed_token_ids", token_id, 0, (1 << 31) - 1)
        if any(not isinstance(word, (tuple, list)) for word in self.bad_words):
            raise SamplingParamsError("bad_words", "must be sequences of token ids")
        words = tuple(tuple(word) for word in self.bad_words)
        object.__setattr__(self, "bad_words", words)
        if len(words) > MAX_BAD_WORDS:
            raise SamplingParamsError(
                "bad_words", f"at most {MAX_BAD_WORDS} token sequences, got {len(words)}"
            )
        for word in words:
            if not 1 <= len(word) <= MAX_BAD_WORD_LEN:
                raise SamplingParamsError(
                    "bad_words", f"each must be 1 to {MAX_BAD_WORD_LEN} tokens, got {len(word)}"
                )
            for token_id in word:
                _check_int("bad_words", token_id, 0, (1 << 31) - 1)
        structured = self.structured_output
        if isinstance(structured, dict):
            structured = StructuredOutput(**structured)
            object.__setattr__(self, "structured_output", structured)
        if structured is not None and not isinstance(structured, StructuredOutput):
            raise SamplingParamsError("structured_output", "must be a StructuredOutput")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def takes_argmax(self) -> bool:
        """Whether every next token is the plain argmax of the model's logits: greedy,
        no logprobs, and nothing that masks, biases or penalises a logit (``min_tokens``
        of at most 1 never bans a token)."""
        return (
            self.temperature == 0.0
            and self.logprobs is None
            and self.structured_output is None
            and self.allowed_token_ids is None
            and not self.logit_bias
            and not self.bad_words
            and self.min_tokens <= 1
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
        )

    def check_limits(self, *, max_n: int, max_logprobs: int, vocab_size: int | None = None) -> None:
        """Checks the limits that depend on the engine's configuration."""
        if self.n > max_n:
            raise SamplingParamsError("n", f"must be in [1, {max_n}], got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise SamplingParamsError(name, f"must be in [0, {max_logprobs}], got {value}")
        if vocab_size is None:
            return
        ids = {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": [token_id for token_id, _ in self.logit_bias],
            "allowed_token_ids": self.allowed_token_ids or (),
            "bad_words": [token_id for word in self.bad_words for token_id in word],
        }
        for name, token_ids in ids.items():
            for token_id in token_ids:
                if token_id >= vocab_size:
                    raise SamplingParamsError(
                        name, f"ids must be in [0, {vocab_size - 1}], got {token_id}"
                    )
