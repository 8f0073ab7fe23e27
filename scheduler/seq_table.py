"""The rank-side view of the running sequences, shared by every executor.

A rank (the real model runner or the fake executor) keeps one
:class:`SequenceTable`. It applies each :class:`StepPlan`'s bookkeeping, hands
out the token ids to compute, records sampled tokens and decides when a
sequence ends (EOS, stop token, length). Pure Python, so the fake executor and
the real runner share exactly the same stop rules.

Everything a rank keeps for one sequence is in its :class:`SeqState`: tokens,
blocks, its row of the penalties' token counts, its grammar matcher, the
prompt logprobs it is gathering. A sequence leaves by one door,
:meth:`SequenceTable.forget` (released by a plan, or ended on the rank), which
hands it to the table's ``on_forget`` for what it holds outside itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .blocks import blocks_before_window, blocks_for
from .messages import (
    FinishedSeq,
    NewSequence,
    PromptLogprobs,
    ScheduledSeq,
    StepPlan,
)
from .request import FinishReason
from .sampling import SamplingParams
from .speculation import speculable


class PlanMismatchError(RuntimeError):
    """A plan disagrees with the rank's own state: a scheduler bug."""


@dataclass(slots=True)
class SeqState:
    seq_id: int
    label: str  # its client's name for it: for messages only
    slot_idx: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Leading entries of block_ids out of every layer's window: the scheduler has
    # handed them on, and they are never read again (see BlockManager).
    num_freed_blocks: int = 0
    lora_slot: int = 0  # the adapter slot its rows compute with; 0: the base model
    # Its row in the rank's token-count tables (penalties; -1: none), and the
    # (length, last token) of the tokens that row counts.
    counts_row: int = -1
    counted: tuple[int, int] = (0, -1)
    grammar: Any = None  # its grammar's matcher state (structured outputs)
    pooled: Any = None  # a pooling runner's sum of its prompt's rows so far (MEAN)
    prompt_logprobs: PromptLogprobs | None = None  # entries gathered, until its prompt is in
    # Positions a draft model (speculative decoding) has computed KV for: it
    # catches up from here in the next step.
    draft_computed: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def stop_reason(
    params: SamplingParams, num_output_tokens: int, token_id: int, eos_token_ids: frozenset[int]
) -> FinishReason | None:
    """Why a sequence ends after sampling ``token_id`` as its ``num_output_tokens``-th token.

    Before ``min_tokens`` nothing stops it (the sampler also masks EOS and the
    stop tokens until then).
    """
    if num_output_tokens < params.min_tokens:
        return None
    if not params.ignore_eos and token_id in eos_token_ids:
        return FinishReason.EOS
    if token_id in params.stop_token_ids:
        return FinishReason.STOP_TOKEN
    if num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    return None


class SequenceTable:
    """Per-slot sequence state on a rank. ``on_forget(seq)`` is called for each
    sequence that leaves, whatever the reason. With the model's ``kv_window`` (every
    layer reads only that many last positions) it tells, by the scheduler's own
    formula, which leading blocks of each sequence the scheduler has handed on:
    a finished sequence releases only the blocks it still held."""

    def __init__(
        self,
        eos_token_ids: frozenset[int] | set[int] = frozenset(),
        on_forget: Callable[[SeqState], None] | None = None,
        *,
        kv_window: int | None = None,
        block_size: int = 1,
        drafts: bool = True,
    ):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.on_forget = on_forget
        self.kv_window, self.block_size = kv_window, block_size
        # Whether the rank has a draft model to make proposals the plan leaves unnamed.
        self.drafts = drafts
        self.by_slot: dict[int, SeqState] = {}
        self.ended: set[int] = set()  # slots whose sequence ended in the current step

    def __len__(self) -> int:
        return len(self.by_slot)

    def apply(self, plan: StepPlan) -> StepPlan:
        """Steps 1-3 of a plan's bookkeeping (see :mod:`messages`). Returns the plan
        to compute: ``plan`` itself, or for a plan built ahead naming sequences the
        previous step ended, a copy in which their entries are padding slots."""
        ended, self.ended = self.ended, set()
        for slot_idx in plan.released_slots:
            self.forget(slot_idx)
        for new in plan.new_seqs:
            self._add(new)
        if plan.ahead and ended:
            plan = self._pad_ended(plan, ended)
        for entry in plan.scheduled:
            seq = self.get(entry.slot_idx)
            if entry.num_draft_tokens:
                self._check_draft(entry, seq)
                # Named proposals join the sequence as the inputs of its rows, until
                # take_drafts keeps those its samples confirm; a draft model's are
                # appended as it makes them.
                seq.token_ids.extend(entry.draft_token_ids)
            if entry.start_pos != seq.num_computed_tokens:
                raise PlanMismatchError(
                    f"slot {entry.slot_idx} ({seq.label}): plan starts at {entry.start_pos}, "
                    f"the rank has {seq.num_computed_tokens} tokens computed"
                )
            if entry.start_pos + entry.num_tokens > len(seq.token_ids) and not (
                entry.num_draft_tokens and not entry.draft_token_ids
            ):
                raise PlanMismatchError(
                    f"slot {entry.slot_idx} ({seq.label}): plan computes up to "
                    f"{entry.start_pos + entry.num_tokens}, sequence has {len(seq.token_ids)} tokens"
                )
            seq.block_ids.extend(entry.new_block_ids)
            seq.num_freed_blocks = max(seq.num_freed_blocks, blocks_before_window(
                entry.start_pos, self.kv_window, self.block_size))  # fmt: skip
        return plan

    def _check_draft(self, entry: ScheduledSeq, seq: SeqState) -> None:
        """An entry with proposals is a decode of a sequence that may speculate,
        its rows its last known token and ``num_draft_tokens`` proposals."""
        k, drafts = entry.num_draft_tokens, entry.draft_token_ids
        if not drafts and not self.drafts:
            raise PlanMismatchError(
                f"slot {entry.slot_idx} ({seq.label}): the plan asks for a draft model's "
                "proposals; none is loaded"
            )
        if not speculable(seq.params):
            raise PlanMismatchError(
                f"slot {entry.slot_idx} ({seq.label}): proposals for a sequence whose "
                "sampling reads its history (penalties or a grammar)"
            )
        if not (entry.sample and entry.num_tokens == 1 + k and len(drafts) in (0, k)
                and entry.start_pos + 1 == len(seq.token_ids)):  # fmt: skip
            raise PlanMismatchError(
                f"slot {entry.slot_idx} ({seq.label}): {k} proposals ({len(drafts)} named) on "
                f"an entry of {entry.num_tokens} tokens from {entry.start_pos}, sequence has "
                f"{len(seq.token_ids)} tokens"
            )

    def take_drafts(
        self, entry: ScheduledSeq, sampled: list[int]
    ) -> tuple[int, FinishedSeq | None]:
        """Verifies ``entry``'s proposals against ``sampled``, the token drawn after
        each of its ``1 + k`` rows (after computing :meth:`advance`; a draft
        model's proposals named in ``entry`` and already appended to the sequence
        as it made them): keeps the
        longest run of proposals equal to the samples before them and appends the
        samples of that run plus the one after it, stopping where the sequence
        ends. Returns how many tokens it appended and the finish record, if any.

        A sequence that goes on keeps its positions up to the last appended
        token's (not that one's: it is computed next) and the blocks that hold
        them; the rest of its table held rejected positions only and is dropped,
        as the scheduler drops it (``Scheduler._settle_drafts``). One that ends
        releases its whole table."""
        seq = self.get(entry.slot_idx)
        drafts = entry.draft_token_ids
        if len(sampled) != 1 + len(drafts):
            raise PlanMismatchError(f"{seq.label}: {len(sampled)} samples for {len(drafts)} "
                                    "proposals")  # fmt: skip
        del seq.token_ids[entry.start_pos + 1 :]  # the proposals were inputs only
        n = 1
        while n <= len(drafts) and drafts[n - 1] == sampled[n - 1]:
            n += 1
        seq.num_computed_tokens = entry.start_pos + n
        # A draft model's KV past the accepted positions was computed from rejected ones.
        seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)
        for i, token in enumerate(sampled[:n]):
            finished = self.append_token(entry.slot_idx, token)
            if finished is not None:
                return i + 1, finished
        keep = max(blocks_for(seq.num_computed_tokens, self.block_size), seq.num_freed_blocks)
        del seq.block_ids[keep:]
        return n, None

    def _pad_ended(self, plan: StepPlan, ended: set[int]) -> StepPlan:
        live: list[ScheduledSeq] = []
        padded: list[ScheduledSeq] = []
        for entry in plan.scheduled:
            stale = entry.slot_idx in ended and entry.slot_idx not in self.by_slot
            (padded if stale else live).append(entry)
        if not padded:
            return plan
        return dataclasses.replace(
            plan, scheduled=live, padding_slots=plan.padding_slots + [e.slot_idx for e in padded]
        )

    def _add(self, new: NewSequence) -> None:
        if new.slot_idx in self.by_slot:
            raise PlanMismatchError(
                f"slot {new.slot_idx} already holds {self.by_slot[new.slot_idx].label}"
            )
        if not 0 <= new.num_cached_tokens < len(new.token_ids):
            # At least the last token is computed, so that there are logits to sample.
            raise PlanMismatchError(
                f"{new.label}: {new.num_cached_tokens} cached tokens of {len(new.token_ids)}"
            )
        self.by_slot[new.slot_idx] = SeqState(
            seq_id=new.seq_id,
            label=new.label,
            slot_idx=new.slot_idx,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            params=new.params,
            num_computed_tokens=new.num_cached_tokens,  # the rest starts where the cache ends
            draft_computed=new.num_cached_tokens,
            lora_slot=new.lora_slot,
        )

    def forget(self, slot_idx: int) -> SeqState | None:
        """Drops the sequence in ``slot_idx`` and all it holds (the one way out)."""
        seq = self.by_slot.pop(slot_idx, None)
        if seq is not None and self.on_forget is not None:
            self.on_forget(seq)
        return seq

    def get(self, slot_idx: int) -> SeqState:
        try:
            return self.by_slot[slot_idx]
        except KeyError:
            raise PlanMismatchError(f"slot {slot_idx} holds no sequence") from None

    def input_ids(self, entry: ScheduledSeq) -> list[int]:
        seq = self.get(entry.slot_idx)
        return seq.token_ids[entry.start_pos : entry.start_pos + entry.num_tokens]

    def advance(self, entry: ScheduledSeq) -> None:
        self.get(entry.slot_idx).num_computed_tokens += entry.num_tokens

    def append_token(self, slot_idx: int, token_id: int) -> FinishedSeq | None:
        """Records a sampled token; returns the finish record if the sequence ended.

        A finished sequence is dropped from the table at once: its slot and
        blocks are the scheduler's to reuse.
        """
        seq = self.get(slot_idx)
        seq.token_ids.append(token_id)
        reason = stop_reason(seq.params, seq.num_output_tokens, token_id, self.eos_token_ids)
        return None if reason is None else self.end(slot_idx, reason)

    def end(self, slot_idx: int, reason: FinishReason) -> FinishedSeq:
        """Ends a sequence without a new token: one whose ``max_tokens`` is 0 once its
        prompt is computed (``length``), or one the rank cannot go on with
        (``error``). Like a stop by a token, it leaves the table at once."""
        seq = self.forget(slot_idx)
        if seq is None:
            raise PlanMismatchError(f"slot {slot_idx} holds no sequence")
        self.ended.add(slot_idx)
        held = seq.block_ids[seq.num_freed_blocks :]
        return FinishedSeq(seq_id=seq.seq_id, reason=reason.value, block_ids=held)
