"""The draft model of speculative decoding (``"method": "draft_model"``).

A small checkpoint that shares the target's tokenizer runs on every rank beside
the target (whole on each rank: tensor parallelism splits only the target). It
has a KV cache of its own laid out like the target's, the same block ids
naming the same positions, so the scheduler's block tables serve both.

Each step, before the target's forward, :meth:`DraftModel.propose`:

1. computes, in one forward, every position the plan's entries compute, from
   the first position the draft has not computed yet (``SeqState.draft_computed``:
   after a draft whose every proposal was accepted, the last proposal's
   position is one it never computed), so that its KV keeps pace with the
   target's; a drafting entry's last row gives its first proposal;
2. then, once per further proposal, one forward over the drafting entries,
   each a single row fed the proposal before it;

and appends the proposals to their sequences, where the target reads them as
the inputs of its rows. Proposals are greedy: a proposal with all its mass on
one token, which the target's comparison accepts with exactly the probability
rejection sampling gives it (:mod:`~iterserve.scheduler.speculation`). After
verification a sequence's draft KV is valid up to its accepted positions
(``SequenceTable.take_drafts`` clamps ``draft_computed``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..scheduler.messages import ScheduledSeq, StepPlan
from ..scheduler.seq_table import SequenceTable
from .batch import Staging, layout_batch, to_device
from .kv_cache import KVCache, bytes_per_block
from .model import Decoder, rope_table
from .sampler import _argmax_rows

__all__ = ["DraftModel", "check_draft", "draft_block_bytes"]


def check_draft(draft_path: str | Path, target_path: str | Path) -> None:
    """Refuses a draft checkpoint the target cannot verify: another vocabulary or
    tokenizer, or a target whose layers slide over a window (the scheduler hands
    on the blocks before it, which a draft with full attention would read)."""
    from .checkpoint import load_checkpoint

    draft, target = Path(draft_path), Path(target_path)
    if not (draft / "config.json").is_file():
        raise ValueError(f"speculative_config.model: no checkpoint at {draft} (config.json)")
    d, t = load_checkpoint(draft), load_checkpoint(target)
    try:
        if d.config.vocab_size != t.config.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary has {d.config.vocab_size} "
                f"tokens, the target's {t.config.vocab_size}: a draft must share the "
                "target's tokenizer"
            )
        if t.config.kv_window is not None:
            raise ValueError(
                "speculative_config: a draft model needs a target whose every layer reads "
                "the whole context (this one slides over a window)"
            )
    finally:
        d.close()
        t.close()
    mine, theirs = _tokenizer_of(draft), _tokenizer_of(target)
    if mine is not None and theirs is not None and mine != theirs:
        raise ValueError(
            "speculative_config.model: the draft's tokenizer.json differs from the "
            "target's: a draft must share the target's tokenizer"
        )


def _tokenizer_of(path: Path) -> dict | None:
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    data = json.loads(file.read_text())
    return {"model": data.get("model"), "added_tokens": data.get("added_tokens")}


def draft_block_bytes(draft_path: str | Path, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block of the draft's cache takes."""
    from .checkpoint import load_checkpoint

    ckpt = load_checkpoint(draft_path)
    c = ckpt.config
    ckpt.close()
    return bytes_per_block(c.num_layers, block_size, c.num_kv_heads, c.head_dim, dtype)


class DraftModel:
    """A draft checkpoint on one rank, with its own KV cache of ``num_kv_blocks``
    blocks (the target's count: one block table names both). ``max_model_len``: the
    context the engine serves, which picks a longrope draft's factors as it does the
    target's (None: the draft checkpoint's own)."""

    def __init__(self, path: str | Path, *, ops, dtype: torch.dtype, device: torch.device,
                 num_kv_blocks: int, block_size: int, pad_token_id: int,
                 max_model_len: int | None = None):  # fmt: skip
        from .checkpoint import load_checkpoint

        ckpt = load_checkpoint(path)
        c = self.config = ckpt.config
        self.model = Decoder(c, ops, rope_table(c, max_model_len), dtype=dtype, device=device,
                                max_model_len=max_model_len)  # fmt: skip
        self.model.load_weights(ckpt)
        ckpt.close()
        if ops.name == "cpu":
            self.model.pack_weights()
        self.kv_cache = KVCache.allocate(
            c.num_layers, num_kv_blocks, block_size, c.num_kv_heads, c.head_dim, dtype, device
        )
        self.model.bind_kv_cache(self.kv_cache)
        self.device = device
        self.block_size = block_size
        self.pad_token_id = pad_token_id
        self.staging = Staging(device) if device.type == "cuda" else None

    def propose(self, plan: StepPlan, table: SequenceTable) -> StepPlan:
        """``plan`` with every entry that asks the draft model for proposals given
        them, appended to its sequence; the draft's KV computed for every position
        the plan computes (see the module docstring). ``table`` has applied it."""
        catch_up: list[ScheduledSeq] = []
        drafting: list[ScheduledSeq] = []
        for entry in plan.scheduled:
            seq = table.get(entry.slot_idx)
            first = min(seq.draft_computed, entry.start_pos)
            drafts = bool(entry.num_draft_tokens and not entry.draft_token_ids)
            if drafts:
                end = entry.start_pos + 1  # its last known token; its proposals come next
                drafting.append(entry)
            else:
                end = entry.start_pos + entry.num_tokens
            catch_up.append(ScheduledSeq(entry.slot_idx, first, end - first, [], drafts))
            seq.draft_computed = end
        proposals: dict[int, list[int]] = {entry.slot_idx: [] for entry in drafting}
        rows = catch_up
        for i in range(max((e.num_draft_tokens for e in drafting), default=0)):
            tokens = self._forward(StepPlan(step=plan.step, scheduled=rows), table)
            for entry, token in zip([e for e in rows if e.sample], tokens, strict=True):
                seq = table.get(entry.slot_idx)
                seq.token_ids.append(token)  # the next row's input, the target's too
                proposals[entry.slot_idx].append(token)
            # Each sequence with proposals still to make: one row, fed the last one.
            rows = []
            for entry in drafting:
                if entry.num_draft_tokens > i + 1:
                    pos = entry.start_pos + i + 1
                    rows.append(ScheduledSeq(entry.slot_idx, pos, 1, [], True))
                    table.get(entry.slot_idx).draft_computed = pos + 1
        if not drafting:  # only catching up
            self._forward(StepPlan(step=plan.step, scheduled=rows), table)
            return plan
        scheduled = [
            dataclasses.replace(e, draft_token_ids=proposals[e.slot_idx])
            if e.slot_idx in proposals else e
            for e in plan.scheduled
        ]  # fmt: skip
        return dataclasses.replace(plan, scheduled=scheduled)

    def _forward(self, plan: StepPlan, table: SequenceTable) -> list[int]:
        """The draft's forward over ``plan``'s rows; the greedy token after each
        sampled entry."""
        if not plan.scheduled:
            return []
        host = layout_batch(
            plan, table, block_size=self.block_size, scratch_block=self.kv_cache.scratch_block,
            pad_token_id=self.pad_token_id, max_position=self.model.cos_sin.shape[0],
        )  # fmt: skip
        batch = to_device(host, self.device, self.staging)
        logits = self.model(batch.input_ids, batch.attn, batch.logits_indices)
        return _argmax_rows(logits) if logits.shape[0] else []
