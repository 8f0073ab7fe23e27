"""Speculative decoding: proposed tokens are tokens in the step's budget.

A decoding sequence's row normally computes one token. With speculation it
computes ``1 + k``: its last known token and ``k`` *proposed* (draft) tokens
guessed to follow it. The ranks run all of them in one forward, sample a token
after each, and keep the longest run of proposals that equals what they
sampled, plus the token sampled after that run::

    known ... x | drafts d1 d2 d3 d4       rows: x d1 d2 d3 d4
    sampled at each row:  t0 t1 t2 t3 t4
    d1 == t0, d2 == t1, d3 != t2  ->  emitted t0 t1 t2 (2 drafts accepted)

Every emitted token is one the sequence would have produced without
speculation: each row samples from the model's distribution given exactly the
tokens before it, and a proposal is kept only when it is what that row drew.
For a greedy row that is token-for-token identity; for a sampled row it is
rejection sampling with a proposal distribution that puts all its mass on the
draft (accept with probability ``p(d)``, else draw from ``p`` without ``d``),
which the race the sampler runs does exactly. A seeded row draws output token
``n`` with the same generator as without speculation, so its tokens are the
same too.

The scheduler owns the blocks: it allocates KV for the proposed positions
when it schedules them and, in the ``update`` that brings the result, gives
back at once the blocks that only rejected positions used. The ranks apply
the same rule to their own tables (:meth:`SequenceTable.take_drafts`).

Where proposals come from (``method``):

- ``ngram`` (prompt lookup): the longest n-gram (``prompt_lookup_min`` ..
  ``prompt_lookup_max`` tokens) that ends the sequence and occurred earlier in
  its prompt or output, and the tokens that followed it there. It needs token
  ids only, so it runs here, in the scheduler, while building the step.
- ``draft_model``: a small model sharing the target's tokenizer (``model``, a
  checkpoint directory) runs on every rank beside the target. The scheduler
  only decides how many proposals a sequence gets and allocates their blocks;
  the ranks' draft model makes them, greedily, one forward per proposal, just
  before the target verifies them (``workers/draft.py``). A greedy draft is a
  proposal with all its mass on one token, so the same comparison keeps the
  target's distribution.

Speculation is skipped, per step and per sequence, where it cannot pay: in a
plan built ahead of the step in flight (the sequence's last token is not known
yet; so while proposals would pay, the scheduler builds no plan ahead and the
step after a draft waits for its result), for a step with more than ``disable_by_batch_size`` decoding sequences
(the step is bound by compute there, not by reading the weights, and extra
rows cost what they compute), for sequences whose sampling reads their own
token history on the ranks (penalties, grammars), near ``max_tokens`` or the
context's end, and when the step's token budget or the free KV blocks run
short (a proposal never preempts anything).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from .sampling import SamplingParams

METHODS = ("ngram", "draft_model")
# Keys of vLLM's --speculative-config that change nothing here, accepted so that a
# vLLM command line works unchanged.
_IGNORED_KEYS = frozenset({
    "enforce_eager", "draft_tensor_parallel_size", "disable_padded_drafter_batch",
    "quantization", "revision", "code_revision",
})  # fmt: skip
# Decoding sequences past which a step proposes nothing, by device, where the config
# leaves it unset (docs/benchmarks.md, speculative decoding). On a CPU, measured with
# `iterserve bench speculative` on the demo model (bf16, 2-core Xeon with AMX): 1 + 4
# rows per sequence gain 1.35x at 8 sequences, 1.24x at 16 and 1.04x at 32. On CUDA,
# from `iterserve simulate --workload speculative` (8B on an H200, each proposal
# accepted with probability 0.5): still 1.26x at 64 sequences, 0.95x at 128.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
CUDA_DISABLE_BY_BATCH_SIZE = 64
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Parsed ``speculative_config`` (vLLM's keys). See the module docstring."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None  # None: by device (resolve())
    model: str | None = None  # the draft model's checkpoint (method draft_model)

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> SpeculativeConfig | None:
        """``None`` or ``{}``: no speculation. Raises ValueError naming the bad key."""
        if not raw:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {raw!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                 "disable_by_batch_size", "model"}  # fmt: skip
        unknown = sorted(set(raw) - known - _IGNORED_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}")
        method = raw.get("method")
        if method is None:
            raise ValueError("speculative_config.method is required: one of " + ", ".join(METHODS))
        if method not in METHODS:
            raise ValueError(
                f"speculative_config.method {method!r} is not supported; supported: "
                + ", ".join(METHODS)
            )
        model = raw.get("model")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config.model: method 'ngram' takes no draft model")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError(
                "speculative_config.model is required for method 'draft_model': the draft "
                "checkpoint's directory"
            )
        k = _int(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5  # vLLM's default
        lo = _int(raw, "prompt_lookup_min", hi, 1, 1 << 16)
        hi = _int(raw, "prompt_lookup_max", lo, 1, 1 << 16)
        if lo > hi:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )
        limit = None
        if raw.get("disable_by_batch_size") is not None:
            limit = _int(raw, "disable_by_batch_size", None, 1, 1 << 20)
        return cls(method, k, lo, hi, limit, model)

    @property
    def max_batch(self) -> int:
        """Decoding sequences past which a step proposes nothing."""
        return self.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE

    def as_dict(self) -> dict[str, Any]:
        out = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
        }
        if self.disable_by_batch_size is not None:
            out["disable_by_batch_size"] = self.disable_by_batch_size
        if self.model is not None:
            out["model"] = self.model
        return out


def batch_limit_for(device: str) -> int:
    """The ``disable_by_batch_size`` a config that leaves it unset gets on ``device``."""
    return (
        CUDA_DISABLE_BY_BATCH_SIZE if device.startswith("cuda") else DEFAULT_DISABLE_BY_BATCH_SIZE
    )


def _int(raw: dict, key: str, default: int | None, lo: int, hi: int) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"speculative_config.{key} is required")
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"speculative_config.{key} must be an integer in [{lo}, {hi}], "
                         f"got {value!r}")  # fmt: skip
    return value


def speculable(params: SamplingParams) -> bool:
    """Whether a sequence's rows may verify proposals: its sampling must not read
    state the ranks advance token by token (penalties' token counts, a grammar's
    matcher), which a row after an unconfirmed proposal cannot have yet."""
    return (
        params.structured_output is None
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
    )


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the longest n-gram (``min_n <= n <=
    max_n``) ending ``tokens`` at its earliest earlier occurrence, as vLLM's
    prompt lookup chooses; ``[]`` when none occurs."""
    total = len(tokens)
    if k <= 0 or total <= min_n:
        return []
    buf = array("I", tokens).tobytes()  # token ids are < 2**32; bytes.find runs in C
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        pattern = buf[(total - n) * 4 :]
        # Occurrences that end before the last token, so that one follows them.
        end = (total - 1) * 4
        at = buf.find(pattern, 0, end)
        while at >= 0 and at % 4:  # a match must start on a token
            at = buf.find(pattern, at + 1, end)
        if at >= 0:
            start = at // 4 + n
            return tokens[start : start + k]
    return []


@dataclass
class SpeculationStats:
    """Counters of proposals and their fate, named after vLLM's ``spec_decode_*``:
    a *draft* is one sequence's proposals in one step."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted plus the token sampled after each draft
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose i+1th was kept
    # [a]: drafts with exactly a proposals kept (the acceptance length histogram)
    acceptance_lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.accepted_per_pos = self.accepted_per_pos or [0] * k
        self.acceptance_lengths = self.acceptance_lengths or [0] * (k + 1)

    def record(self, num_proposed: int, num_emitted: int) -> None:
        accepted = max(0, min(num_emitted - 1, num_proposed))
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += num_emitted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        self.acceptance_lengths[accepted] += 1

    def since(self, before: SpeculationStats | None) -> SpeculationStats:
        """What was recorded after ``before`` (a copy of these counters taken
        earlier; None: since the start), as counters of their own. A copy of now's
        is ``self.since(None)``."""
        if before is None:
            before = SpeculationStats(self.num_speculative_tokens)
        return SpeculationStats(
            self.num_speculative_tokens,
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            self.num_emitted_tokens - before.num_emitted_tokens,
            [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos, strict=True)],
            [
                a - b
                for a, b in zip(self.acceptance_lengths, before.acceptance_lengths, strict=True)
            ],  # fmt: skip
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_emitted_tokens": self.num_emitted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_acceptance_lengths": list(self.acceptance_lengths),
        }
