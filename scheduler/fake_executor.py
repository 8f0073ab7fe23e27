"""A deterministic stand-in for the rank actors.

It consumes real :class:`StepPlan` messages and answers real
:class:`StepResult` messages, keeping the same rank-side bookkeeping
(:class:`SequenceTable`) as the model runner, so the scheduler, the Ray actor,
the Serve app and the benchmarks run end to end without a model.

The token at output position ``i`` of a request depends only on its label (the
name its client gave it, ``NewSequence.label``; a request added to a scheduler
directly has its id as its label) and ``i``: a preempted request that is recomputed produces the same tokens, and
tests can predict every request's exact output. A request ends with EOS after
``output_len(request_id)`` tokens (``None``: never by itself).

With ``check_kv`` it also models the KV cache's content: the step that computes
position ``p`` of a sequence writes, into the slot its block table names, a
digest of the sequence's tokens up to ``p``; after a step's writes (a rank
writes every entry's K/V before any attends), every position an entry attends
to must hold its own sequence's digest. A cached block that holds another
prefix, a shared block overwritten, a block handed out while still read: each
fails the step. With a ``kv_window`` (the model's: every layer reads only the
last ``kv_window`` positions) an entry attends to its window only, and the
blocks before it, which the scheduler hands on, may hold anything.

With ``num_host_blocks`` it also models the KV tiers (:class:`KVTransfers`): host
slots hold copies of blocks' contents, and ``kv_disk`` (a dict standing in for
the disk's files, shared by the executors of one test: key -> (content, parent,
tokens)) the copies written down. A read completes ``read_delay`` steps after
its plan; one whose entry is gone or :data:`CORRUPT` fails (and the entry goes).
Loaded blocks then face the same attention checks as computed ones.
"""

from __future__ import annotations

import dataclasses
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .blocks import blocks_for
from .messages import (
    KVReport,
    KVTransfers,
    PooledOutput,
    PromptLogprobs,
    SampledToken,
    StepPlan,
    StepResult,
)
from .request import FinishReason
from .sampling import SamplingParams
from .seq_table import SequenceTable, stop_reason

OutputLen = Callable[[str], "int | None"]
CORRUPT = "corrupt"  # a file of the stand-in disk that fails its checksum


class FakeExecutor:
    def __init__(
        self,
        *,
        vocab_size: int = 32000,
        eos_token_id: int = 2,
        output_len: OutputLen | int | None = None,
        step_sleep_s: float = 0.0,
        check_blocks: bool = True,
        block_size: int | None = None,
        check_kv: bool = False,
        kv_window: int | None = None,
        period: int | None = None,
        acceptance: float | None = None,
        seed: int = 0,
        pooling: str | None = None,
        hidden_size: int = 8,
        num_host_blocks: int = 0,
        kv_disk: dict | None = None,
        read_delay: int = 1,
    ):
        if isinstance(output_len, int) or output_len is None:
            fixed = output_len
            output_len = lambda _request_id: fixed  # noqa: E731
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.output_len = output_len
        self.step_sleep_s = step_sleep_s
        self.check_blocks = check_blocks
        self.block_size = block_size
        self.kv_window = kv_window
        self.period = period
        # A model of acceptance instead of the tokens' own (the simulator's): each
        # proposal, after the ones accepted before it, is kept with this probability.
        self.acceptance = acceptance
        # A pooling runner's stand-in (``LAST`` or ``MEAN``): a prompt's vector is its
        # tokens' (token_vector), pooled as the runner pools hidden states.
        self.pooling, self.hidden_size = pooling, hidden_size
        self._rng = random.Random(seed)
        self.table = SequenceTable({eos_token_id}, kv_window=kv_window, block_size=block_size or 1)
        self.num_steps = 0
        self.check_kv = check_kv and bool(block_size)
        self._kv: dict[int, list[tuple[int, int] | None]] = {}  # block -> (pos, digest) per slot
        self._digests: dict[int, list[int]] = {}  # seq_id -> digest of tokens [0, p] per p
        # The KV tiers' stand-ins: host slot -> content, the disk, reads in flight.
        self.num_host_blocks = num_host_blocks
        self.kv_disk = kv_disk if kv_disk is not None else {}
        self.read_delay = read_delay
        self._host: dict[int, list | None] = {}
        self._reads: list[tuple[int, int, int, str]] = []  # (due step, read id, slot, key)
        self._report = KVReport()

    def token_at(self, request_id: str, output_pos: int) -> int:
        """The non-EOS token a request produces at output position ``output_pos``
        (with a ``period``, the tokens repeat: what prompt lookup guesses right)."""
        if self.period:
            output_pos %= self.period
        h = zlib.crc32(f"{request_id}:{output_pos}".encode())
        token = 3 + h % (self.vocab_size - 3)
        return token

    def expected_output(self, request_id: str, params: SamplingParams) -> tuple[list[int], str]:
        """The exact tokens and finish reason the fake produces for a request."""
        tokens: list[int] = []
        while True:
            token = self._next_token(request_id, len(tokens), params)
            tokens.append(token)
            reason = stop_reason(params, len(tokens), token, self.table.eos_token_ids)
            if reason is not None:
                return tokens, reason.value

    def _next_token(self, request_id: str, output_pos: int, params: SamplingParams) -> int:
        target = self.output_len(request_id)
        # Like the real sampler, EOS is masked until min_tokens is reached.
        if target is not None and output_pos + 1 >= max(target, params.min_tokens + 1):
            return self.eos_token_id
        return self.token_at(request_id, output_pos)

    def token_vector(self, token_id: int) -> list[float]:
        """The stand-in "hidden state" of a token: ``hidden_size`` numbers in [-1, 1)."""
        return [zlib.crc32(f"{token_id}:{i}".encode()) / 2**31 - 1 for i in range(self.hidden_size)]

    def pooled(self, prompt: list[int]) -> list[float]:
        """What the pooling stand-in answers for ``prompt``."""
        if self.pooling == "LAST":
            return self.token_vector(prompt[-1])
        vectors = [self.token_vector(t) for t in prompt]
        return [sum(column) / len(prompt) for column in zip(*vectors)]

    @staticmethod
    def _prompt_logprobs(seq) -> PromptLogprobs:
        """Every prompt token after the first at logprob -0.5, the most likely."""
        tokens = seq.token_ids[1 : seq.num_prompt_tokens]
        top = [[(t, -0.5)][: seq.params.prompt_logprobs] for t in tokens]
        return PromptLogprobs(seq.seq_id, [-0.5] * len(tokens), [1] * len(tokens), top)

    def kv_tier_info(self) -> dict | None:
        """What the engine learns of this rank's tiers at start (see ``KVTiers``);
        None without tiers."""
        if not self.num_host_blocks:
            return None
        disk = [(key, parent, tokens) for key, (_, parent, tokens) in self.kv_disk.items()]
        return {"num_host_blocks": self.num_host_blocks, "block_bytes": 1 << 16,
                "load_s_per_block": 1e-6, "compute_s_per_token": 1e-4, "disk": disk}  # fmt: skip

    def _transfers(self, kv: KVTransfers | None) -> None:
        """A plan's tier moves, in a rank's order; reads complete ``read_delay`` later."""
        if kv is not None:
            kv_cache = self._kv
            for block, slot in zip(kv.store_blocks, kv.store_slots, strict=True):
                content = kv_cache.get(block)
                self._host[slot] = None if content is None else list(content)
            for slot, block in zip(kv.load_slots, kv.load_blocks, strict=True):
                content = self._host[slot]
                if content is None:
                    kv_cache.pop(block, None)
                else:
                    kv_cache[block] = list(content)
            if kv.clear_disk:
                self.kv_disk.clear()
            for slot, key, parent, tokens in zip(kv.write_slots, kv.write_keys,
                                                 kv.write_parents, kv.write_tokens):  # fmt: skip
                self.kv_disk.pop(key, None)  # a rewrite is the newest file
                self.kv_disk[key] = (self._host[slot], parent, tuple(tokens))
            for key in kv.delete_keys:
                self.kv_disk.pop(key, None)
            due = self.num_steps + self.read_delay
            for read_id, slot, key in zip(kv.read_ids, kv.read_slots, kv.read_keys):
                self._reads.append((due, read_id, slot, key))
        while self._reads and self._reads[0][0] <= self.num_steps:
            _, read_id, slot, key = self._reads.pop(0)
            entry = self.kv_disk.get(key)
            if entry is None or entry[0] == CORRUPT:
                self.kv_disk.pop(key, None)
                self._report.reads_failed.append(read_id)
            else:
                self._host[slot] = None if entry[0] is None else list(entry[0])
                self._report.reads_done.append(read_id)

    def _take_report(self) -> KVReport | None:
        report = self._report
        if not (report.reads_done or report.reads_failed or report.writes_dropped):
            return None
        self._report = KVReport()
        return report

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        if self.num_host_blocks:
            self._transfers(plan.kv)
        plan = self.table.apply(plan)
        result = StepResult(
            step=plan.step, num_tokens=plan.num_tokens, num_padding_tokens=plan.num_padding_tokens
        )
        if self.num_host_blocks:
            result.kv = self._take_report()
        if any(e.num_draft_tokens and not e.draft_token_ids for e in plan.scheduled):
            plan = self._draft(plan)
        if self.check_kv:
            self._check_kv(plan)
        for entry in plan.scheduled:
            seq = self.table.get(entry.slot_idx)
            if self.check_blocks and self.block_size:
                needed = blocks_for(entry.start_pos + entry.num_tokens, self.block_size)
                if len(seq.block_ids) < needed:
                    raise AssertionError(
                        f"{seq.label}: {len(seq.block_ids)} blocks cannot hold "
                        f"{entry.start_pos + entry.num_tokens} tokens"
                    )
            self.table.advance(entry)
            if entry.num_draft_tokens:
                self._verify(entry, seq, result)
                continue
            if not entry.sample:
                continue
            if seq.params.prompt_logprobs is not None and not seq.num_output_tokens:
                result.prompt_logprobs.append(self._prompt_logprobs(seq))
            if seq.params.max_tokens == 0:  # the prompt alone was asked for
                if self.pooling is not None:
                    prompt = seq.token_ids[: seq.num_prompt_tokens]
                    result.pooled.append(PooledOutput(seq.seq_id, self.pooled(prompt)))
                result.finished.append(self.table.end(entry.slot_idx, FinishReason.LENGTH))
                continue
            token = self._next_token(seq.label, seq.num_output_tokens, seq.params)
            logprob = -0.5 if seq.params.logprobs is not None else None
            top = [(token, -0.5)][: seq.params.logprobs or 0]
            result.sampled.append(SampledToken(seq.seq_id, token, logprob, top))
            finished = self.table.append_token(entry.slot_idx, token)
            if finished is not None:
                result.finished.append(finished)
        if self.check_kv and len(self._digests) > 2 * len(self.table) + 16:
            live = {seq.seq_id for seq in self.table.by_slot.values()}
            self._digests = {k: v for k, v in self._digests.items() if k in live}
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        self.num_steps += 1
        result.forward_s = time.perf_counter() - start
        return result

    def _draft(self, plan: StepPlan) -> StepPlan:
        """The stand-in for a draft model: it proposes the tokens the sequence will
        produce, except where a hash of the position says it guesses wrong (about
        one in three), and appends them to the sequence as a draft model does."""
        scheduled = []
        for entry in plan.scheduled:
            if entry.num_draft_tokens and not entry.draft_token_ids:
                seq = self.table.get(entry.slot_idx)
                first = entry.start_pos + 1 - seq.num_prompt_tokens
                drafts = []
                for i in range(entry.num_draft_tokens):
                    token = self._next_token(seq.label, first + i, seq.params)
                    if zlib.crc32(f"draft:{seq.label}:{first + i}".encode()) % 3 == 0:
                        token = 3 + (token - 2) % (self.vocab_size - 3)  # a wrong guess
                    drafts.append(token)
                seq.token_ids.extend(drafts)
                entry = dataclasses.replace(entry, draft_token_ids=drafts)
            scheduled.append(entry)
        return dataclasses.replace(plan, scheduled=scheduled)

    def _verify(self, entry, seq, result: StepResult) -> None:
        """A draft's rows: the token each row would sample is the one of its output
        position, whatever came before (the fake's tokens depend on nothing else)."""
        first = entry.start_pos + 1 - seq.num_prompt_tokens  # output position of row 0's token
        sampled = [
            self._next_token(seq.label, first + i, seq.params) for i in range(entry.num_tokens)
        ]
        if self.acceptance is not None:
            sampled = self._modelled(entry.draft_token_ids, sampled, seq.label, first)
        seq_id, wants = seq.seq_id, seq.params.logprobs
        num_kept, finished = self.table.take_drafts(entry, sampled)
        if seq_id in self._digests:  # those of rejected proposals' positions are stale
            del self._digests[seq_id][seq.num_computed_tokens :]
        for token in sampled[:num_kept]:
            top = [(token, -0.5)][: wants or 0]
            result.sampled.append(
                SampledToken(seq_id, token, -0.5 if wants is not None else None, top)
            )
        if finished is not None:
            result.finished.append(finished)

    def _modelled(self, drafts: list[int], sampled: list[int], label: str, first: int):
        """Samples that accept a run of ``drafts`` drawn by ``acceptance`` (never past
        the sequence's own end), then differ from the next proposal."""
        assert self.acceptance is not None
        target = self.output_len(label)
        limit = len(drafts) if target is None else max(0, min(len(drafts), target - 1 - first))
        accepted = 0
        while accepted < limit and self._rng.random() < self.acceptance:
            accepted += 1
        out = drafts[:accepted] + sampled[accepted:]
        if accepted < len(drafts) and out[accepted] == drafts[accepted]:
            out[accepted] = 3 + (drafts[accepted] - 2) % (self.vocab_size - 3)  # any other
        return out

    def _digest(self, seq, pos: int) -> int:
        digests = self._digests.setdefault(seq.seq_id, [])
        while len(digests) <= pos:
            prev = digests[-1] if digests else 0
            digests.append(zlib.crc32(f"{prev}:{seq.token_ids[len(digests)]}".encode()))
        return digests[pos]

    def _check_kv(self, plan: StepPlan) -> None:
        size = self.block_size
        assert size is not None
        empty: list[tuple[int, int] | None] = [None] * size
        for entry in plan.scheduled:  # every write first, as a rank's layers do
            seq = self.table.get(entry.slot_idx)
            for pos in range(entry.start_pos, entry.start_pos + entry.num_tokens):
                block = seq.block_ids[pos // size]
                content = self._kv.setdefault(block, list(empty))
                content[pos % size] = (pos, self._digest(seq, pos))
        for entry in plan.scheduled:
            seq = self.table.get(entry.slot_idx)
            first = entry.start_pos - self.kv_window + 1 if self.kv_window else 0
            for pos in range(max(0, first), entry.start_pos + entry.num_tokens):
                block = seq.block_ids[pos // size]
                held = self._kv.get(block, empty)[pos % size]
                if held != (pos, self._digest(seq, pos)):
                    raise AssertionError(
                        f"{seq.label}: block {block} does not hold its KV of position "
                        f"{pos} in step {plan.step}"
                    )


@dataclass(frozen=True)
class FakeModel:
    """An engine's stand-in model: each rank runs a :class:`FakeExecutor` (the
    control plane on its own, outputs a test can predict). Given to an engine in
    code (``AsyncEngine(config, executor=FakeModel(...))``), it is out of reach of
    any deployment config. ``max_model_len`` and ``vocab_size`` are the facts of
    the checkpoint it stands in for; the rest are :class:`FakeExecutor`'s."""

    vocab_size: int = 32000
    max_model_len: int = 2048
    eos_token_id: int = 2
    output_len: int | None = None
    step_sleep_s: float = 0.0
    check_blocks: bool = True
    period: int | None = None
    hidden_size: int = 8
    # The KV tiers' stand-in: a block's bytes (host blocks are the config's
    # kv_offloading_size over it), and the dict that stands in for the disk's files.
    kv_block_bytes: int = 1 << 16
    kv_disk: dict | None = None

    def model_info(self, config: Any, device: str, level: str | None = None) -> dict:
        return {
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
        }

    def kv_capacity(self, config: Any, rank: int, world_size: int, device: str,
                    runtime: dict | None = None) -> int:  # fmt: skip
        return 4096

    def build(self, config: Any, rank: int, world_size: int, device: str, all_reduce: Any,
              runtime: dict | None = None):  # fmt: skip
        return FakeExecutor(**self.executor_options(config))

    def executor_options(self, config: Any) -> dict:
        """:class:`FakeExecutor`'s keywords, for an engine of ``config``."""
        return dict(
            vocab_size=self.vocab_size,
            eos_token_id=self.eos_token_id,
            output_len=self.output_len,
            step_sleep_s=self.step_sleep_s,
            check_blocks=self.check_blocks,
            block_size=config.scheduler.block_size,
            period=self.period,
            pooling=config.pooling_type if config.runner == "pooling" else None,
            hidden_size=self.hidden_size,
            num_host_blocks=int(
                getattr(config, "kv_offloading_size", 0) * (1 << 30) / self.kv_block_bytes
            ),
            kv_disk=self.kv_disk,
        )
