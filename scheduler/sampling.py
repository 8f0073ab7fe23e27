"""Sampling parameters and their validation.

Every check raises :class:`SamplingParamsError` whose message names the field and
the allowed range, so the HTTP layer can return it verbatim as a 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63 - 1


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
        _check_int("max_tokens", self.max_tokens, 1, 1 << 30)
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_limits(self, *, max_n: int, max_logprobs: int, vocab_size: int | None = None) -> None:
        """Checks the limits that depend on the engine's configuration."""
        if self.n > max_n:
            raise SamplingParamsError("n", f"must be in [1, {max_n}], got {self.n}")
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise SamplingParamsError(
                "logprobs", f"must be in [0, {max_logprobs}], got {self.logprobs}"
            )
        if vocab_size is not None:
            for token_id in self.stop_token_ids:
                if token_id >= vocab_size:
                    raise SamplingParamsError(
                        "stop_token_ids", f"ids must be in [0, {vocab_size - 1}], got {token_id}"
                    )
