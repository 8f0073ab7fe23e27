"""Per-request token counts on the device, for the sampler's penalties.

Repetition penalty needs the set of tokens a sequence has seen (prompt and
output), presence and frequency penalties the count of each output token.
Rebuilding them from the token lists every step costs host work and a copy
per row; instead each request with a penalty owns one row of two device
tables, filled once from its tokens and then advanced by the sampler with the
token it draws, on the device, with no host round trip::

    prompt_seen [capacity, vocab] bool     output [capacity, vocab] float32

A table row is the sequence's own (``SeqState.counts_row``, with what it counts in
``SeqState.counted``), handed back with :meth:`TokenCounts.release` when the
sequence leaves the rank. It is trusted only while the sequence is exactly what
the counts last saw (same length, same last token); otherwise, as after a
preemption re-sends the request, it is rebuilt from the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class CountedRow(Protocol):
    token_ids: list[int]
    num_prompt_tokens: int
    counts_row: int  # -1: none yet
    counted: tuple[int, int]  # (length, last token) the row counts


def _last(ids: list[int]) -> tuple[int, int]:
    return (len(ids), ids[-1] if ids else -1)


class TokenCounts:
    """The device tables; which row is whose is written on the sequences."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._free: list[int] = []
        self.prompt_seen = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.output = torch.zeros(0, 0, device=self.device)

    def release(self, row: CountedRow) -> None:
        """Hands a leaving sequence's table row back."""
        if row.counts_row >= 0:
            self._free.append(row.counts_row)
            row.counts_row = -1

    def slots(self, rows: Sequence[CountedRow], vocab: int) -> list[int]:
        """The table row of each of ``rows``, brought up to date with its tokens."""
        if self.output.shape[1] != vocab:
            if self.output.shape[0]:
                raise ValueError(f"token counts of {self.output.shape[1]} ids, asked for {vocab}")
            self._resize(0, vocab)
        stale = []
        out = []
        for r in rows:
            if r.counts_row < 0:
                r.counts_row = self._take(vocab)
                stale.append(r)
            elif r.counted != _last(r.token_ids):
                stale.append(r)
            out.append(r.counts_row)
        if stale:
            self._rebuild(stale)
        return out

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Counts one drawn token per row (both ``[m]`` device tensors)."""
        self.output.index_put_((slots, tokens), torch.ones_like(slots, dtype=self.output.dtype),
                               accumulate=True)  # fmt: skip

    def drawn(self, rows: Sequence[CountedRow], tokens: Sequence[int]) -> None:
        """Records that ``tokens`` (already counted by :meth:`add`) will end ``rows``."""
        for r, t in zip(rows, tokens):
            r.counted = (len(r.token_ids) + 1, t)

    def _take(self, vocab: int) -> int:
        if not self._free:
            old = self.output.shape[0]
            self._resize(max(8, 2 * old), vocab)
            self._free.extend(range(self.output.shape[0] - 1, old - 1, -1))
        return self._free.pop()

    def _resize(self, capacity: int, vocab: int) -> None:
        seen = torch.zeros(capacity, vocab, dtype=torch.bool, device=self.device)
        output = torch.zeros(capacity, vocab, device=self.device)
        n = self.output.shape[0]
        if n:
            seen[:n] = self.prompt_seen
            output[:n] = self.output
        self.prompt_seen, self.output = seen, output

    def _rebuild(self, stale: list[CountedRow]) -> None:
        # One upload for all stale rows: (row, token, is_output) triples.
        slot_of, token_of, is_output = [], [], []
        for r in stale:
            ids = r.token_ids
            slot_of += [r.counts_row] * len(ids)
            token_of += ids
            is_output += [0] * r.num_prompt_tokens + [1] * (len(ids) - r.num_prompt_tokens)
            r.counted = _last(ids)
        dev = self.device
        vocab = self.output.shape[1]
        slots = torch.tensor([r.counts_row for r in stale], device=dev)
        self.prompt_seen[slots] = False
        self.output[slots] = 0.0
        if not token_of:
            return
        triples = torch.tensor([slot_of, token_of, is_output], device=dev)  # [3, n]
        keep = triples[1] < vocab  # ids past the vocabulary count for nothing
        rows, toks, outs = triples[0][keep], triples[1][keep], triples[2][keep].bool()
        self.prompt_seen[rows[~outs], toks[~outs]] = True
        self.output.index_put_(
            (rows[outs], toks[outs]), torch.ones_like(rows[outs], dtype=self.output.dtype),
            accumulate=True,
        )  # fmt: skip
