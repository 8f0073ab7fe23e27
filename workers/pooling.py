"""A pooling runner's step after the forward: each prompt's final hidden states
(after the model's last norm, what transformers calls ``last_hidden_state``)
pooled into one vector, as vLLM's ``LAST`` and ``MEAN`` pooling do.

A pooling sequence asks for no token (``max_tokens`` 0): its prompt is computed,
in pieces under chunked prefill, and the piece that completes it is the entry
that "samples" (``ScheduledSeq.sample``). Real rows are laid out entry by entry
(:mod:`.batch`), so an entry's rows are the next ``num_tokens`` of the batch::

    rows:   A0 A1 A2 | B5 B6 | C0 C1 C2 C3     A and C complete their prompts,
                                               B's piece is a middle one
    LAST:   A2, C3                             the completing pieces' last rows
    MEAN:   every row; per sequence the sum of its pieces (``SeqState.pooled``,
            fp32), divided by its prompt length when the prompt completes

MEAN needs every token's row, so its engines run without prefix caching (a
cached block's rows are never computed); LAST needs only the last, which a
prompt always computes. A preempted sequence starts over, its sum with it.
"""

from __future__ import annotations

import torch

from ..scheduler.messages import PooledOutput, ScheduledSeq
from ..scheduler.seq_table import SequenceTable

POOLING_TYPES = ("LAST", "MEAN")


class Pooler:
    """The pooling of one runner (``pooling_type``: ``LAST`` or ``MEAN``)."""

    def __init__(self, pooling_type: str):
        if pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}"
            )
        self.mean = pooling_type == "MEAN"

    def rows(self, entries: list[ScheduledSeq]) -> torch.Tensor:
        """The rows of the flat batch whose hidden states the step pools."""
        num_rows = sum(e.num_tokens for e in entries)
        if self.mean:
            return torch.arange(num_rows, dtype=torch.long)
        ends, end = [], 0
        for entry in entries:
            end += entry.num_tokens
            if entry.sample:
                ends.append(end - 1)
        return torch.tensor(ends, dtype=torch.long)

    def take(
        self, hidden: torch.Tensor, entries: list[ScheduledSeq], table: SequenceTable
    ) -> list[PooledOutput]:
        """The pooled vectors of the sequences whose prompts this step completes;
        ``hidden``: [len(rows), hidden_size], the :meth:`rows` of the step."""
        pooled: list[PooledOutput] = []
        if not self.mean:
            done = [table.get(e.slot_idx) for e in entries if e.sample]
            vectors = hidden.float().cpu().tolist()
            return [PooledOutput(seq.seq_id, vector) for seq, vector in zip(done, vectors)]
        start = 0
        for entry in entries:
            seq = table.get(entry.slot_idx)
            piece = hidden[start : start + entry.num_tokens].float().sum(dim=0)  # [hidden_size]
            start += entry.num_tokens
            seq.pooled = piece if seq.pooled is None else seq.pooled + piece
            if entry.sample:
                mean = seq.pooled / seq.num_prompt_tokens
                pooled.append(PooledOutput(seq.seq_id, mean.cpu().tolist()))
                seq.pooled = None
        return pooled
