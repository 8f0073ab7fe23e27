"""The log-probabilities of prompt tokens, for the sequences that ask for them.

The model computes logits only for the rows it is asked for; a step adds to
them the rows of every prompt piece whose sequence wants its prompt's
logprobs. Row ``p`` (position ``p``) predicts token ``p + 1``, so a prompt of
``P`` tokens has ``P - 1`` entries, and its last row is the one the first
output token is sampled from (not a prompt entry)::

    prompt   t0  t1  t2  t3  t4          P = 5, pieces [0, 3) and [3, 5)
    rows     r0  r1  r2 |r3  r4
    entries  t1  t2  t3 |t4  (r4 samples the first output token)

Entries gather piece by piece on the sequence itself (``SeqState.prompt_logprobs``)
and leave once, with the step that completes the prompt. A sequence sent again
with tokens it produced (after a preemption or a restart) had its prompt's
entries already: it is not collected again. Only rank 0's result is read, so
only rank 0 collects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scheduler.messages import PromptLogprobs, StepPlan
from ..scheduler.seq_table import SeqState, SequenceTable


@dataclass
class PromptRows:
    """One step's prompt rows: where they are in the flat batch, and what they predict."""

    rows: list[int]  # flat batch row of each entry
    seqs: list[SeqState]
    targets: list[int]  # the prompt token each row predicts
    top: list[int]  # alternatives wanted, per row


class PromptLogprobsCollector:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def add(self, seq: SeqState) -> None:
        if self.enabled and seq.params.prompt_logprobs is not None and not seq.num_output_tokens:
            seq.prompt_logprobs = PromptLogprobs(seq.seq_id)

    @staticmethod
    def pop(seq: SeqState) -> PromptLogprobs | None:
        """A sequence's entries, once its prompt is computed."""
        entries, seq.prompt_logprobs = seq.prompt_logprobs, None
        return entries

    def rows(self, plan: StepPlan, table: SequenceTable) -> PromptRows | None:
        """The prompt rows of ``plan`` (already applied to ``table``). Rows are laid
        out entry by entry, in plan order (:mod:`.batch`)."""
        if not self.enabled:
            return None
        found = PromptRows([], [], [], [])
        offset = 0
        for entry in plan.scheduled:
            seq = table.get(entry.slot_idx)
            if seq.prompt_logprobs is not None:
                last = min(entry.start_pos + entry.num_tokens, seq.num_prompt_tokens - 1)
                for pos in range(entry.start_pos, last):
                    found.rows.append(offset + pos - entry.start_pos)
                    found.seqs.append(seq)
                    found.targets.append(seq.token_ids[pos + 1])
                    found.top.append(seq.params.prompt_logprobs or 0)
            offset += entry.num_tokens
        return found if found.rows else None

    def take(self, logits: torch.Tensor, rows: PromptRows) -> None:
        """Records the entries of ``rows`` from their logits (``[len(rows), vocab]``)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(rows.targets, device=logits.device)[:, None]
        chosen = logprobs.gather(1, targets)  # [n, 1]
        rank = (logprobs > chosen).sum(dim=-1) + 1
        parts = [chosen.squeeze(1).double(), rank.double()]
        k = min(max(rows.top), logits.shape[1])
        if k:
            vals, ids = logprobs.topk(k, dim=-1)
            parts += [vals.double().reshape(-1), ids.double().reshape(-1)]
        host = torch.cat(parts).cpu()  # one copy back
        n = len(rows.rows)
        chosen_l, rank_l = host[:n].tolist(), host[n : 2 * n].long().tolist()
        top_vals = host[2 * n : 2 * n + n * k].reshape(n, k).tolist()
        top_ids = host[2 * n + n * k :].reshape(n, k).long().tolist()
        for i, seq in enumerate(rows.seqs):
            entry = seq.prompt_logprobs
            assert entry is not None
            entry.token_logprobs.append(chosen_l[i])
            entry.ranks.append(rank_l[i])
            want = rows.top[i]
            entry.top_logprobs.append(list(zip(top_ids[i][:want], top_vals[i][:want])))
