"""Per-request token counts on the device, for the sampler's penalties.

Repetition penalty needs the set of tokens a sequence has seen (prompt and
output), presence and frequency penalties the count of each output token.
Rebuilding them from the token lists every step costs host work and a copy
per row; instead each request with a penalty owns one row of two device
tables, filled once from its tokens and then advanced by the sampler with the
token it draws, on the device, with no host round trip::

    prompt_seen [capacity, vocab] bool     output [capacity, vocab] float32

A row is trusted only while the sequence is exactly what the counts last saw
(same length, same last token); otherwise, as after a preemption re-sends the
request, it is rebuilt from the tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch


class CountedRow(Protocol):
    token_ids: list[int]
    num_prompt_tokens: int


class TokenCounts:
    """``key(row)`` names a row's sequence: the same key, the same counts."""

    def __init__(self, device: torch.device, key: Callable[[Any], Hashable]):
        self.device = torch.device(device)
        self.key = key
        self._slot: dict[Hashable, int] = {}
        self._seen: dict[Hashable, tuple[int, int]] = {}  # key -> (length, last token) counted
        self._free: list[int] = []
        self.prompt_seen = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.output = torch.zeros(0, 0, device=self.device)

    def forget(self, key: Hashable) -> None:
        slot = self._slot.pop(key, None)
        if slot is not None:
            self._seen.pop(key, None)
            self._free.append(slot)

    def slots(self, rows: Sequence[CountedRow], vocab: int) -> list[int]:
        """The table row of each of ``rows``, brought up to date with its tokens."""
        if self.output.shape[1] != vocab:
            self._resize(0, vocab)
        stale = []
        out = []
        for r in rows:
            key = self.key(r)
            slot = self._slot.get(key)
            if slot is None:
                slot = self._take(vocab)
                self._slot[key] = slot
            ids = r.token_ids
            if self._seen.get(key) != (len(ids), ids[-1] if ids else -1):
                stale.append((slot, r))
            out.append(slot)
        if stale:
            self._rebuild(stale, vocab)
        return out

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Counts one drawn token per row (both ``[m]`` device tensors)."""
        self.output.index_put_((slots, tokens), torch.ones_like(slots, dtype=self.output.dtype),
                               accumulate=True)  # fmt: skip

    def drawn(self, rows: Sequence[CountedRow], tokens: Sequence[int]) -> None:
        """Records that ``tokens`` (already counted by :meth:`add`) will end ``rows``."""
        for r, t in zip(rows, tokens):
            self._seen[self.key(r)] = (len(r.token_ids) + 1, t)

    def _take(self, vocab: int) -> int:
        if not self._free:
            old = self.output.shape[0]
            self._resize(max(8, 2 * old), vocab)
            self._free.extend(range(self.output.shape[0] - 1, old - 1, -1))
        return self._free.pop()

    def _resize(self, capacity: int, vocab: int) -> None:
        seen = torch.zeros(capacity, vocab, dtype=torch.bool, device=self.device)
        output = torch.zeros(capacity, vocab, device=self.device)
        if self.output.shape[1] == vocab:
            n = self.output.shape[0]
            seen[:n] = self.prompt_seen
            output[:n] = self.output
        else:  # a new vocabulary: nothing carries over
            self._slot.clear()
            self._seen.clear()
            self._free.clear()
        self.prompt_seen, self.output = seen, output

    def _rebuild(self, stale: list[tuple[int, CountedRow]], vocab: int) -> None:
        # One upload for all stale rows: (row, token, is_output) triples.
        slot_of, token_of, is_output = [], [], []
        for slot, r in stale:
            ids = r.token_ids
            slot_of += [slot] * len(ids)
            token_of += ids
            is_output += [0] * r.num_prompt_tokens + [1] * (len(ids) - r.num_prompt_tokens)
            self._seen[self.key(r)] = (len(ids), ids[-1] if ids else -1)
        dev = self.device
        slots = torch.tensor([s for s, _ in stale], device=dev)
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
