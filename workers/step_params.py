"""One step's per-row sampling parameters, indices and bans, built on the host
from Python lists and moved to the device in one copy (see :mod:`.sampler`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ..scheduler.sampling import SamplingParams

if TYPE_CHECKING:
    from .batch import Staging
    from .grammar import GrammarMask
    from .token_counts import TokenCounts


class SampleRow(Protocol):
    """What the sampler reads of a sequence (``SeqState`` satisfies it); its
    token-count row is the sequence's own (:mod:`.token_counts`)."""

    seq_id: int
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    counts_row: int
    counted: tuple[int, int]


class DraftRow:
    """A sampler row of a sequence's draft (speculative decoding): the sequence as
    it would be after the proposals before this row, ``token_ids[:length]``. Only
    sequences whose sampling reads no rank-side history speculate (no penalties,
    no grammar: ``speculation.speculable``), so nothing else differs."""

    __slots__ = ("seq_id", "params", "token_ids", "num_prompt_tokens")
    counts_row = -1
    counted = (0, -1)
    grammar = None

    def __init__(self, seq: SampleRow, length: int):
        self.seq_id = seq.seq_id
        self.params = seq.params
        self.token_ids = seq.token_ids[:length]
        self.num_prompt_tokens = seq.num_prompt_tokens


class StepParams:
    """One step's per-row sampling parameters and row indices, on the device
    after a single copy. ``get(name)`` returns a float64 view to cast."""

    def __init__(
        self,
        rows: list[SampleRow],
        vocab: int,
        grammar: GrammarMask | None,
        *,
        eos_token_ids: list[int],
        counts: TokenCounts,
        staging: Staging,
    ):
        params = [r.params for r in rows]
        self.greedy = [i for i, p in enumerate(params) if p.greedy]
        self.random = [i for i, p in enumerate(params) if not p.greedy]
        self.grammar = grammar
        self.banned_rows: list[int] = []
        banned_tokens: list[int] = []
        for i, r in enumerate(rows):
            banned = [t for t in _banned(r, eos_token_ids) if t < vocab]
            self.banned_rows += [i] * len(banned)
            banned_tokens += banned
        self.allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        allowed_pos, allowed_tokens = [], []
        for k, i in enumerate(self.allowed):
            ids = [t for t in params[i].allowed_token_ids or () if t < vocab]
            allowed_pos += [k] * len(ids)
            allowed_tokens += ids
        self.biased = [i for i, p in enumerate(params) if p.logit_bias]
        bias_rows, bias_tokens, bias_values = [], [], []
        for i in self.biased:
            pairs = [(t, b) for t, b in params[i].logit_bias if t < vocab]
            bias_rows += [i] * len(pairs)
            bias_tokens += [t for t, _ in pairs]
            bias_values += [b for _, b in pairs]
        self.rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        self.oa = [
            i
            for i, p in enumerate(params)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        ]
        self.counted = sorted(set(self.rep) | set(self.oa))
        slot_of = dict(zip(self.counted, counts.slots([rows[i] for i in self.counted], vocab)))
        drawn = [params[i] for i in self.random]
        fields = {
            "greedy": self.greedy,
            "random": self.random,
            "allowed": self.allowed,
            "allowed_pos": allowed_pos,
            "allowed_tokens": allowed_tokens,
            "banned_rows": self.banned_rows,
            "banned_tokens": banned_tokens,
            "bias_rows": bias_rows,
            "bias_tokens": bias_tokens,
            "bias_values": bias_values,
            "rep": self.rep,
            "rep_slots": [slot_of[i] for i in self.rep],
            "rep_penalty": [params[i].repetition_penalty for i in self.rep],
            "oa": self.oa,
            "oa_slots": [slot_of[i] for i in self.oa],
            "freq": [params[i].frequency_penalty for i in self.oa],
            "pres": [params[i].presence_penalty for i in self.oa],
            "counted": self.counted,
            "count_slots": [slot_of[i] for i in self.counted],
            "temperature": [p.temperature for p in drawn],
            "shared": [i for i, p in enumerate(drawn) if p.seed is None],
            "top_k": [p.top_k if 0 < p.top_k < vocab else vocab for p in drawn],
            # Rows without top-p get an unreachable limit: rounding can push the
            # cumulative mass to just over 1.0.
            "top_p": [p.top_p if p.top_p < 1.0 else 2.0 for p in drawn],
            "min_p": [p.min_p for p in drawn],
        }
        names = list(fields)
        views = staging.put([torch.tensor(fields[k], dtype=torch.float64) for k in names])
        self._views = dict(zip(names, views))

    def get(self, name: str) -> torch.Tensor:
        return self._views[name]

    @property
    def changes_logits(self) -> bool:
        """Whether any row has a mask, bias or penalty (``Sampler._process`` applies
        them); False lets a batch sample from the logits as they are."""
        return bool(
            self.grammar is not None
            or self.allowed
            or self.banned_rows
            or self.biased
            or self.rep
            or self.oa
        )


def _banned(row: SampleRow, eos_token_ids: list[int]) -> list[int]:
    """The tokens a row may not sample now: the stop and EOS tokens before
    ``min_tokens`` (without a grammar), and the last token of every bad word the
    output leads into."""
    p = row.params
    num_output = len(row.token_ids) - row.num_prompt_tokens
    banned = []
    # A grammar decides where its output ends: banning EOS before min_tokens could
    # leave its row nothing to sample.
    if num_output + 1 < p.min_tokens and p.structured_output is None:
        banned += p.stop_token_ids
        if not p.ignore_eos:
            banned += eos_token_ids
    for word in p.bad_words:
        lead = len(word) - 1  # the tokens that must end the output for the ban to hold
        if lead == 0 or (
            lead <= num_output and tuple(row.token_ids[len(row.token_ids) - lead :]) == word[:-1]
        ):
            banned.append(word[-1])
    return banned
