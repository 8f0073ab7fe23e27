"""Turns one step's logits into one token per sampled sequence.

Per row, in order:

1. **min_tokens** — while the token being sampled could not end the sequence
   (``outputs_so_far + 1 < min_tokens``, the rule of
   :func:`~iterserve.scheduler.seq_table.stop_reason`), the stop token ids and,
   unless ``ignore_eos``, the EOS ids get ``-inf``.
2. **repetition_penalty** (Hugging Face): every token seen in prompt or output
   has its logit divided by the penalty when positive, multiplied when negative.
3. **presence / frequency penalties** (OpenAI): over output tokens only,
   ``logit -= frequency * count + presence * (count > 0)``.
4. **greedy** (``temperature == 0``): argmax of these logits.
5. otherwise ``logits / temperature``, then **top_k**, **top_p** (smallest set
   whose probability reaches ``top_p``, at least one token) and **min_p**
   (drops tokens below ``min_p * max_prob``), then a draw from the softmax.

Logprobs are the *raw model* log-probabilities (``log_softmax`` of the logits
before any of the steps above), as vLLM returns them by default.

Draws use the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``), which picks
token ``i`` with probability ``p_i``. A seeded request draws its ``q`` from its
own generator, seeded once, so its tokens do not depend on what else shares the
batch; unseeded requests share one generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from iterserve.scheduler.sampling import SamplingParams


class SampleRow(Protocol):
    """What the sampler reads of a sequence (``SeqState`` satisfies it)."""

    seq_id: int
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int], device: str | torch.device, seed: int = 0):
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = torch.device(device)
        # Every tensor-parallel rank seeds this identically, so all ranks draw
        # the same tokens and their sequence tables stay in step.
        self._shared = torch.Generator(device=self.device).manual_seed(seed)
        self._seeded: dict[int, torch.Generator] = {}

    def forget(self, seq_id: int) -> None:
        """Drops a finished or released sequence's generator."""
        self._seeded.pop(seq_id, None)

    def _generator(self, row: SampleRow) -> torch.Generator:
        gen = self._seeded.get(row.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(row.params.seed)
            self._seeded[row.seq_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        """``logits`` is ``[len(rows), vocab]``; row ``i`` belongs to ``rows[i]``."""
        logits = logits.float()  # [n, vocab]
        n, vocab = logits.shape
        params = [r.params for r in rows]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        logits = self.process(logits, rows)
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        random = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            tokens[idx] = logits[idx].argmax(dim=-1)
        if random:
            idx = torch.tensor(random, device=logits.device)
            tokens[idx] = self._draw(logits[idx], [rows[i] for i in random])

        token_list = tokens.tolist()
        out = SamplerOutput(token_ids=token_list)
        for i, p in enumerate(params):
            if raw_logprobs is None or p.logprobs is None:
                out.logprobs.append(None)
                out.top_logprobs.append([])
                continue
            out.logprobs.append(float(raw_logprobs[i, token_list[i]]))
            top = []
            if p.logprobs > 0:
                vals, ids = raw_logprobs[i].topk(min(p.logprobs, vocab))
                top = list(zip(ids.tolist(), vals.tolist(), strict=True))
            out.top_logprobs.append(top)
        return out

    def process(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Steps 1-3: min_tokens masking and penalties, on a float copy of ``logits``."""
        logits = logits.float().clone()
        self._mask_stops(logits, rows)
        self._penalise(logits, rows, logits.shape[1])
        return logits

    def _mask_stops(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        for i, r in enumerate(rows):
            p = r.params
            if len(r.token_ids) - r.num_prompt_tokens + 1 >= p.min_tokens:
                continue
            banned = list(p.stop_token_ids)
            if not p.ignore_eos:
                banned += self.eos_token_ids
            banned = [t for t in banned if t < logits.shape[1]]
            if banned:
                logits[i, banned] = float("-inf")

    def _penalise(self, logits: torch.Tensor, rows: list[SampleRow], vocab: int) -> None:
        rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if rep:
            idx = torch.tensor(rep, device=logits.device)
            seen = _counts([rows[i].token_ids for i in rep], vocab, logits.device) > 0
            penalty = torch.tensor(
                [rows[i].params.repetition_penalty for i in rep], device=logits.device
            )[:, None]
            sub = logits[idx]
            scaled = torch.where(sub > 0, sub / penalty, sub * penalty)
            logits[idx] = torch.where(seen, scaled, sub)
        oa = [
            i
            for i, r in enumerate(rows)
            if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
        ]
        if oa:
            idx = torch.tensor(oa, device=logits.device)
            outputs = [rows[i].token_ids[rows[i].num_prompt_tokens :] for i in oa]
            counts = _counts(outputs, vocab, logits.device)
            freq = torch.tensor([rows[i].params.frequency_penalty for i in oa], device=idx.device)
            pres = torch.tensor([rows[i].params.presence_penalty for i in oa], device=idx.device)
            logits[idx] -= freq[:, None] * counts + pres[:, None] * (counts > 0).float()

    def _draw(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        params = [r.params for r in rows]
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], device=dev)[:, None]
        logits = logits / temp  # [m, vocab]
        logits = _filter(logits, params)
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs)
        shared = [i for i, p in enumerate(params) if p.seed is None]
        if shared:
            idx = torch.tensor(shared, device=dev)
            q[idx] = torch.empty(len(shared), probs.shape[1], device=dev).exponential_(
                generator=self._shared
            )
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                q[i].exponential_(generator=self._generator(r))
        # An Exp(1) draw can be exactly 0; keep the quotient finite.
        return (probs / q.clamp_min_(1e-20)).argmax(dim=-1)


def _counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(seqs), vocab]`` float occurrence counts of each token id."""
    counts = torch.zeros(len(seqs), vocab, device=device)
    longest = max((len(s) for s in seqs), default=0)
    if longest == 0:
        return counts
    ids = torch.full((len(seqs), longest), vocab, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long).clamp_(max=vocab)
    ids = ids.to(device)
    # Column ``vocab`` catches the padding (and any out-of-range id) and is dropped.
    wide = torch.zeros(len(seqs), vocab + 1, device=device)
    wide.scatter_add_(1, ids, torch.ones_like(ids, dtype=wide.dtype))
    return wide[:, :vocab]


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top-k, then top-p, then min-p; removed tokens get ``-inf``."""
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if not any(top_k) and all(p >= 1.0 for p in top_p) and not any(min_p):
        return logits
    m, vocab = logits.shape
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [m, vocab]
    rank = torch.arange(vocab, device=dev)[None, :]
    if any(top_k):
        k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k], device=dev)
        sorted_logits.masked_fill_(rank >= k[:, None], float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        # Rows without top-p get an unreachable limit: rounding can push the
        # cumulative mass to just over 1.0.
        limit = torch.tensor([p if p < 1.0 else 2.0 for p in top_p], device=dev)[:, None]
        # Hugging Face's rule; the best token always has before == 0 and stays.
        drop = (before >= limit) & (rank > 0)
        sorted_logits.masked_fill_(drop, float("-inf"))
    if any(min_p):
        probs = torch.softmax(sorted_logits, dim=-1)
        floor = torch.tensor(min_p, device=dev)[:, None] * probs[:, :1]
        sorted_logits.masked_fill_(probs < floor, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
