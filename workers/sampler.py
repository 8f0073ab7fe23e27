"""Turns one step's logits into one token per sampled sequence.

Per row, in order:

1. **grammar** (structured outputs) — every token the sequence's grammar does
   not allow next gets ``-inf``: one bitmask for the step's constrained rows,
   filled on the host by their matchers (:mod:`.grammar`), applied in one go.
2. **allowed_token_ids** — every other token gets ``-inf``.
3. **min_tokens** — while the token being sampled could not end the sequence
   (``outputs_so_far + 1 < min_tokens``, the rule of
   :func:`~iterserve.scheduler.seq_table.stop_reason`), the stop token ids and,
   unless ``ignore_eos``, the EOS ids get ``-inf``. **bad_words** too: the last
   token of every bad word whose other tokens end the output so far (a one-token
   word always).
4. **logit_bias** — each biased token's logit plus its bias.
5. **repetition_penalty** (Hugging Face): every token seen in prompt or output
   has its logit divided by the penalty when positive, multiplied when negative.
6. **presence / frequency penalties** (OpenAI): over output tokens only,
   ``logit -= frequency * count + presence * (count > 0)``.
7. **greedy** (``temperature == 0``): argmax of these logits.
8. otherwise ``logits / temperature``, then **top_k**, **top_p** (smallest set
   whose probability reaches ``top_p``, at least one token) and **min_p**
   (drops tokens below ``min_p * max_prob``), then a draw from the softmax.

Logprobs are the *raw model* log-probabilities (``log_softmax`` of the logits
before any of the steps above, the grammar's mask included), as vLLM returns
them by default.

Draws use the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``), which picks
token ``i`` with probability ``p_i``. A seeded request draws the ``q`` of its
output token ``k`` from a generator seeded with ``(seed, k)``: its position in
its random stream is its number of output tokens, which a sequence carries
through a preemption or a worker restart (it comes back with the tokens it
produced), so its draws resume where they stopped instead of starting over, and
its tokens do not depend on what else shares the batch. Unseeded requests share
one generator.

Host work per step is a few Python lists: every per-row parameter and index
crosses to the device in one copy (a pinned buffer on CUDA), the penalties read
device-side token counts (:mod:`.token_counts`), and everything the host needs
back (tokens, logprobs) returns in one copy, the step's only wait on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..scheduler.sampling import SamplingParams
from .batch import Staging
from .step_params import SampleRow, StepParams
from .token_counts import TokenCounts

if TYPE_CHECKING:
    from .grammar import GrammarMask


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's output function: nearby inputs give unrelated 64-bit outputs."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw for output token ``position``.
    Mixed, not added: choice ``j`` of a request runs with ``seed + j``, and its
    draws must not be its neighbour's shifted by one token."""
    return _mix64(_mix64(seed) ^ position)


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's first largest index. Logits on the CPU go through numpy, whose
    argmax is vectorized: 64 rows of 4096 fp32 take ~20 µs there against ~220 µs in
    torch's; bf16 and fp16 ones are widened to fp32 first (exact), which with
    numpy's argmax takes a tenth of torch's bf16 argmax (64 x 4096: ~0.1 against
    ~1.5 ms; 64 x 128256: ~10 against ~47 ms). Both take the first of equal values
    and a NaN as the largest."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1).tolist()
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return logits.numpy().argmax(axis=-1).tolist()


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
        self._positioned = torch.Generator(device=self.device)  # seeded rows: see draw_seed
        self._counts = TokenCounts(self.device)
        # Parameters and indices cross as float64: exact for every int id and for
        # the Python floats, which then round to fp32 as torch.tensor would.
        self._staging = Staging(self.device, torch.float64)
        self._mask_staging = Staging(self.device, torch.int32)  # grammar bitmasks

    def release(self, row: SampleRow) -> None:
        """Hands back what a sequence leaving the rank holds here: its row of the
        token counts (its draws need nothing kept: see the module docstring)."""
        self._counts.release(row)

    def step_params(
        self, rows: list[SampleRow], vocab: int, grammar: GrammarMask | None
    ) -> StepParams:
        return StepParams(
            rows, vocab, grammar,
            eos_token_ids=self.eos_token_ids, counts=self._counts, staging=self._staging,
        )  # fmt: skip

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRow], grammar: GrammarMask | None = None
    ) -> SamplerOutput:
        """``logits`` is ``[len(rows), vocab]``; row ``i`` belongs to ``rows[i]``.
        ``grammar``: the step's bitmask for the rows that have a grammar."""
        if grammar is None and all(r.params.takes_argmax for r in rows):
            # Nothing to change and nothing to report but the tokens: the common
            # greedy batch needs no per-row parameters on the device.
            tokens = _argmax_rows(logits)  # the step's one wait on the device
            n = len(tokens)
            return SamplerOutput(tokens, [None] * n, [[] for _ in range(n)])
        logits = logits.float()  # [n, vocab]
        n, vocab = logits.shape
        params = [r.params for r in rows]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        batch = self.step_params(rows, vocab, grammar)
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

    def process(
        self, logits: torch.Tensor, rows: list[SampleRow], grammar: GrammarMask | None = None
    ) -> torch.Tensor:
        """Steps 1-6: masks, bias and penalties, on a float copy of ``logits``."""
        batch = self.step_params(rows, logits.shape[1], grammar)
        out = self._process(logits.float(), rows, batch)
        return out.clone() if out is logits else out

    def _process(self, logits: torch.Tensor, rows: list[SampleRow], batch: StepParams):
        if not batch.changes_logits:
            return logits  # nothing to change: no copy (a greedy batch's common case)
        logits = logits.clone()
        if batch.grammar is not None:
            from .grammar import apply_token_bitmask

            (bitmask,) = self._mask_staging.put([batch.grammar.bitmask])
            apply_token_bitmask(logits, batch.grammar, bitmask)
        if batch.allowed:
            idx = batch.get("allowed").long()
            keep = torch.zeros(len(batch.allowed), logits.shape[1], dtype=torch.bool,
                               device=logits.device)  # fmt: skip
            keep[batch.get("allowed_pos").long(), batch.get("allowed_tokens").long()] = True
            logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))
        if batch.banned_rows:
            logits[batch.get("banned_rows").long(), batch.get("banned_tokens").long()] = float(
                "-inf"
            )
        if batch.biased:
            rows_t, tokens = batch.get("bias_rows").long(), batch.get("bias_tokens").long()
            logits.index_put_((rows_t, tokens), batch.get("bias_values").float(), accumulate=True)
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

    def _draw(self, logits: torch.Tensor, rows: list[SampleRow], batch: StepParams):
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
            gen = self._positioned
            for i, r in enumerate(rows):
                if r.params.seed is not None:
                    gen.manual_seed(
                        draw_seed(r.params.seed, len(r.token_ids) - r.num_prompt_tokens)
                    )
                    q[i].exponential_(generator=gen)
        # An Exp(1) draw can be exactly 0; keep the quotient finite.
        return (probs / q.clamp_min_(1e-20)).argmax(dim=-1)


def _filter(logits: torch.Tensor, params: list[SamplingParams], batch: StepParams):
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
