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

Host work per step is a few Python lists: every per-row parameter and index
crosses to the device in one copy (a pinned buffer on CUDA), the penalties read
device-side token counts (:mod:`.token_counts`), and everything the host needs
back (tokens, logprobs) returns in one copy, the step's only wait on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from iterserve.scheduler.sampling import SamplingParams
from iterserve.workers.batch import Staging
from iterserve.workers.token_counts import TokenCounts


def sequence_key(row: SampleRow) -> int:
    """What names a row's sequence across steps: its generator and token counts
    live under this key until :meth:`Sampler.forget`."""
    return row.seq_id


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
        self._counts = TokenCounts(self.device, key=sequence_key)
        # Parameters and indices cross as float64: exact for every int id and for
        # the Python floats, which then round to fp32 as torch.tensor would.
        self._staging = Staging(self.device, torch.float64)

    def forget(self, key: str) -> None:
        """Drops a finished or released sequence's generator and token counts
        (``key`` as :func:`sequence_key` gives it)."""
        self._seeded.pop(key, None)
        self._counts.forget(key)

    def _generator(self, row: SampleRow) -> torch.Generator:
        key = sequence_key(row)
        gen = self._seeded.get(key)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(row.params.seed)
            self._seeded[key] = gen
        return gen

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        """``logits`` is ``[len(rows), vocab]``; row ``i`` belongs to ``rows[i]``."""
        logits = logits.float()  # [n, vocab]
        n, vocab = logits.shape
        params = [r.params for r in rows]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        batch = _StepParams(self, rows, vocab)
        logits = self._process(logits, rows, batch)
        if not batch.random:
            tokens = logits.argmax(dim=-1)
        elif not batch.greedy:
            tokens = self._draw(logits, rows, batch)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=logits.device)
            idx = batch.get("greedy").long()
            tokens[idx] = logits[idx].argmax(dim=-1)
            idx = batch.get("random").long()
            tokens[idx] = self._draw(logits[idx], [rows[i] for i in batch.random], batch)
        if batch.counted:
            self._counts.add(batch.get("count_slots").long(), tokens[batch.get("counted").long()])

        # Everything the host needs, in one copy: tokens, then each asking row's
        # logprob, then its top logprobs (values, then ids).
        parts = [tokens.double()]
        top_n = max((p.logprobs or 0 for p in params), default=0)
        top_n = min(top_n, vocab)
        if raw_logprobs is not None:
            parts.append(raw_logprobs.gather(1, tokens[:, None]).squeeze(1).double())
            if top_n:
                vals, ids = raw_logprobs.topk(top_n, dim=-1)  # [n, top_n]
                parts += [vals.double().reshape(-1), ids.double().reshape(-1)]
        host = torch.cat(parts).cpu()
        token_list = host[:n].long().tolist()
        if batch.counted:
            self._counts.drawn(
                [rows[i] for i in batch.counted], [token_list[i] for i in batch.counted]
            )
        out = SamplerOutput(token_ids=token_list)
        if raw_logprobs is None:
            out.logprobs = [None] * n
            out.top_logprobs = [[] for _ in range(n)]
            return out
        chosen = host[n : 2 * n].tolist()
        top_vals = host[2 * n : 2 * n + n * top_n].reshape(n, top_n).tolist()
        top_ids = host[2 * n + n * top_n :].reshape(n, top_n).long().tolist()
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.logprobs.append(None)
                out.top_logprobs.append([])
                continue
            out.logprobs.append(chosen[i])
            k = min(p.logprobs, vocab)
            out.top_logprobs.append(list(zip(top_ids[i][:k], top_vals[i][:k])))
        return out

    def process(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Steps 1-3: min_tokens masking and penalties, on a float copy of ``logits``."""
        return self._process(logits.float(), rows, _StepParams(self, rows, logits.shape[1]))

    def _process(self, logits: torch.Tensor, rows: list[SampleRow], batch: _StepParams):
        logits = logits.clone()
        if batch.banned_rows:
            logits[batch.get("banned_rows").long(), batch.get("banned_tokens").long()] = float(
                "-inf"
            )
        if batch.rep:
            idx = batch.get("rep").long()
            slots = batch.get("rep_slots").long()
            seen = self._counts.prompt_seen[slots] | (self._counts.output[slots] > 0)
            penalty = batch.get("rep_penalty").float()[:, None]
            sub = logits[idx]
            scaled = torch.where(sub > 0, sub / penalty, sub * penalty)
            logits[idx] = torch.where(seen, scaled, sub)
        if batch.oa:
            idx = batch.get("oa").long()
            counts = self._counts.output[batch.get("oa_slots").long()]  # [m, vocab]
            freq = batch.get("freq").float()
            pres = batch.get("pres").float()
            logits[idx] -= freq[:, None] * counts + pres[:, None] * (counts > 0).float()
        return logits

    def _draw(self, logits: torch.Tensor, rows: list[SampleRow], batch: _StepParams):
        params = [r.params for r in rows]
        dev = logits.device
        temp = batch.get("temperature").float()[:, None]
        logits = logits / temp  # [m, vocab]
        logits = _filter(logits, params, batch)
        probs = torch.softmax(logits, dim=-1)
        shared = [i for i, p in enumerate(params) if p.seed is None]
        if len(shared) == len(params):
            q = torch.empty_like(probs).exponential_(generator=self._shared)
        else:
            q = torch.empty_like(probs)
            if shared:
                idx = batch.get("shared").long()
                q[idx] = torch.empty(len(shared), probs.shape[1], device=dev).exponential_(
                    generator=self._shared
                )
            for i, r in enumerate(rows):
                if r.params.seed is not None:
                    q[i].exponential_(generator=self._generator(r))
        # An Exp(1) draw can be exactly 0; keep the quotient finite.
        return (probs / q.clamp_min_(1e-20)).argmax(dim=-1)


class _StepParams:
    """One step's per-row sampling parameters and row indices, on the device
    after a single copy. ``get(name)`` returns a float64 view to cast."""

    def __init__(self, sampler: Sampler, rows: list[SampleRow], vocab: int):
        params = [r.params for r in rows]
        self.greedy = [i for i, p in enumerate(params) if p.greedy]
        self.random = [i for i, p in enumerate(params) if not p.greedy]
        self.banned_rows: list[int] = []
        banned_tokens: list[int] = []
        for i, r in enumerate(rows):
            p = r.params
            if len(r.token_ids) - r.num_prompt_tokens + 1 >= p.min_tokens:
                continue
            banned = list(p.stop_token_ids)
            if not p.ignore_eos:
                banned += sampler.eos_token_ids
            banned = [t for t in banned if t < vocab]
            self.banned_rows += [i] * len(banned)
            banned_tokens += banned
        self.rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        self.oa = [
            i
            for i, p in enumerate(params)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        ]
        self.counted = sorted(set(self.rep) | set(self.oa))
        slot_of = dict(
            zip(self.counted, sampler._counts.slots([rows[i] for i in self.counted], vocab))
        )
        drawn = [params[i] for i in self.random]
        fields = {
            "greedy": self.greedy,
            "random": self.random,
            "banned_rows": self.banned_rows,
            "banned_tokens": banned_tokens,
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
        views = sampler._staging.put([torch.tensor(fields[k], dtype=torch.float64) for k in names])
        self._views = dict(zip(names, views))

    def get(self, name: str) -> torch.Tensor:
        return self._views[name]


def _filter(logits: torch.Tensor, params: list[SamplingParams], batch: _StepParams):
    """top-k, then top-p, then min-p; removed tokens get ``-inf``."""
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if not any(top_k) and all(p >= 1.0 for p in top_p) and not any(min_p):
        return logits
    m, vocab = logits.shape
    dev = logits.device
    k = batch.get("top_k").long()
    if all(p >= 1.0 for p in top_p) and not any(min_p):
        return _top_k_only(logits, [t for t in top_k if 0 < t < vocab], k)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [m, vocab]
    rank = torch.arange(vocab, device=dev)[None, :]
    if any(top_k):
        sorted_logits.masked_fill_(rank >= k[:, None], float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        limit = batch.get("top_p").float()[:, None]
        # Hugging Face's rule; the best token always has before == 0 and stays.
        drop = (before >= limit) & (rank > 0)
        sorted_logits.masked_fill_(drop, float("-inf"))
    if any(min_p):
        probs = torch.softmax(sorted_logits, dim=-1)
        floor = batch.get("min_p").float()[:, None] * probs[:, :1]
        sorted_logits.masked_fill_(probs < floor, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _top_k_only(logits: torch.Tensor, ks: list[int], k: torch.Tensor) -> torch.Tensor:
    """top-k without sorting the vocabulary: the largest k of each row keep their
    logits. Rows without top-k (k == vocab) keep all of theirs."""
    if not ks:
        return logits
    vocab = logits.shape[1]
    vals, idx = logits.topk(max(ks), dim=-1)  # [m, k_max], best first
    rank = torch.arange(vals.shape[1], device=logits.device)[None, :]
    vals = vals.masked_fill(rank >= k[:, None], float("-inf"))
    kept = torch.full_like(logits, float("-inf")).scatter_(-1, idx, vals)
    return torch.where((k < vocab)[:, None], kept, logits)
