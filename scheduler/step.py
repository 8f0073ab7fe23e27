"""What one ``schedule()`` call builds, and what the engine hands back with its result.

A :class:`StepBuilder` is made for one call and thrown away after it. It owns
the step being built: the token budget, the entries, the new sequences, the
padding slots, whether the step is built ahead of one in flight, whether it
preempted. Policies read the scheduler and write to it only through its small
API::

    step.running / step.waiting             who could run (to read: the builder admits)
    step.waiting.order_key / yields_to      the order of service (scheduling_policy)
    step.victim()                           whom a preemption takes, in that order
    step.num_to_compute(request)            tokens before its next sample, after any
                                            cached prefix a waiting request would reuse
    step.try_schedule(request, num_tokens)  tokens of one request, admitting it
    step.schedule_decodes(requests)         one token each (and proposals), the hot path
    step.drop_proposals()                   before a preemption: proposals give way
    step.preempt(request)                   free its blocks and slot, recompute later
    step.pad_slot(slot_idx)                 a padding row (static batching)

:meth:`StepBuilder.build` turns it into a :class:`ScheduledStep`: the plan for
the ranks and what ``update`` needs to take the result; the scheduler keeps
it in its queue of steps in flight until then, and hands it back from
``update`` with the step's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .blocks import blocks_before_window
from .messages import NewSequence, ScheduledSeq, StepPlan
from .request import Request, RequestOutput
from .speculation import propose_ngram, speculable

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .core import Scheduler
    from .queue import WaitingQueue


@dataclass(slots=True)
class ScheduledStep:
    """A plan handed to the ranks, with what the scheduler needs to take its
    result: the request each entry computes, and what the step changed in
    tables it did not grow (``freed_before``: seq_id -> the leading blocks a
    table had handed on before this step handed on more out of its window), so
    that the blocks a sequence held after the step before it can be told
    (``Scheduler._held_after``). ``update`` fills in ``outputs``."""

    plan: StepPlan
    requests: dict[int, Request]  # slot_idx -> the request its entry computes
    freed_before: dict[int, int] = field(default_factory=dict)
    scheduled_at: float = 0.0  # the ``now`` it was scheduled at
    num_draft_tokens: int = 0  # proposed tokens it verifies (speculative decoding)
    outputs: list[RequestOutput] = field(default_factory=list)  # what update took from it
    _by_slot: dict[int, ScheduledSeq] | None = None

    def entry_of(self, request: Request) -> ScheduledSeq | None:
        """The entry computing ``request`` in this step, if any."""
        if self.requests.get(request.slot_idx) is not request:
            return None
        if self._by_slot is None:  # built on the first question: finishes are rare
            self._by_slot = {entry.slot_idx: entry for entry in self.plan.scheduled}
        return self._by_slot[request.slot_idx]


class StepBuilder:
    """One step being built; see the module docstring."""

    def __init__(self, sched: Scheduler, *, ahead: bool):
        self.sched = sched
        self.ahead = ahead  # built while the step before it runs
        self.budget_left = sched.config.token_budget
        # slot -> tokens of this step's pieces of prompts longer than the short budget
        # (room_for)
        self.long_pieces: dict[int, int] = {}
        self.new_seqs: list[NewSequence] = []
        self.scheduled: list[ScheduledSeq] = []
        self.padding_slots: list[int] = []
        self.requests: dict[int, Request] = {}  # slot_idx -> request, for scheduled entries
        self.preempted = False
        self.num_draft_tokens = 0  # proposed tokens among the scheduled ones
        self.freed_before: dict[int, int] = {}  # see ScheduledStep

    # -- what policies read --------------------------------------------------------

    @property
    def running(self) -> Iterable[Request]:
        return self.sched.running.values()

    @property
    def waiting(self) -> WaitingQueue:
        return self.sched.waiting

    @property
    def num_free_slots(self) -> int:
        return self.sched.slots.num_free

    @property
    def num_free_blocks(self) -> int:
        return self.sched.blocks.num_free

    def room_for(self, remaining: int) -> int:
        """The budget a piece of a request with ``remaining`` tokens before its next
        sample may take: all that is left when it is longer than the scheduler's
        short budget (:meth:`.SchedulerConfig.short_budget`), else what the short
        budget leaves after this step's decodes and short pieces."""
        short = self.sched.short_budget
        if short is None or remaining > short:
            return self.budget_left
        long_tokens = sum(self.long_pieces.values())
        spent = self.sched.config.token_budget - self.budget_left - long_tokens
        return max(0, min(self.budget_left, short - spent))

    def num_to_compute(self, request: Request) -> int:
        """Tokens ``request`` computes before its next sample: for a waiting request,
        those after the prefix it would find cached."""
        if request.slot_idx < 0:
            hit = self.sched.prefix.hit(request)
            return request.num_remaining_tokens - len(hit) * self.sched.config.block_size
        return request.num_remaining_tokens

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """New blocks ``request`` needs so that ``num_tokens`` of its tokens fit."""
        return self.sched.blocks.num_needed(request.request_id, num_tokens)

    def adapter_fits(self, request: Request) -> bool:
        """Whether a waiting request's adapter (if any) can be resident for it now:
        it is, or a slot is free, or an idle adapter can give up its slot."""
        adapter = request.adapter
        return adapter is None or request.slot_idx >= 0 or self.sched.adapters.can_pin(adapter)

    def can_admit(self, request: Request) -> bool:
        """Whether a waiting request may be admitted now: its adapter fits
        (:meth:`adapter_fits`) and no disk read of its leading blocks is in flight."""
        tiers = self.sched.tiers
        return self.adapter_fits(request) and (tiers is None or tiers.can_admit(request))

    def is_scheduled(self, request: Request) -> bool:
        return self.requests.get(request.slot_idx) is request

    def victim(self) -> Request | None:
        """Whom a preemption takes now: the last running request in the order of
        service, among those not admitted in this step (None: nobody)."""
        new = {n.seq_id for n in self.new_seqs}
        return self.sched.waiting.victim(r for r in self.running if r.seq_id not in new)

    # -- what policies do ----------------------------------------------------------

    def try_schedule(
        self, request: Request, num_tokens: int, num_pad_tokens: int = 0, reserve_tokens: int = 0
    ) -> bool:
        """Schedules ``num_tokens`` more of ``request``'s tokens in this step,
        admitting it to a slot if it has none: then it starts after the prefix it
        finds cached (see :meth:`num_to_compute`). ``reserve_tokens`` allocates
        blocks for that many tokens up front. Returns False when the KV blocks
        cannot be allocated, changing nothing but handing on the blocks out of the
        request's window, as it would have anyway."""
        sched = self.sched
        admitting = request.slot_idx < 0
        if admitting and not self.can_admit(request):
            return False
        hit = sched.prefix.hit(request) if admitting else []
        start = len(hit) * sched.config.block_size if admitting else request.num_computed_tokens
        target = start + num_tokens
        if not admitting:  # first, so that the allocation may take them
            self._free_out_of_window(request, start)
        new_blocks = sched.blocks.allocate(request.request_id, max(target, reserve_tokens), hit)
        if new_blocks is None:
            return False
        if admitting:
            # A long cached prefix may reach back past the window already.
            self._free_out_of_window(request, start)
            self.new_seqs.append(sched.admit(request, start))
            if sched.tiers is not None and hit:
                sched.tiers.count_hit(request, hit)
        sample = target == request.num_tokens + request.num_pending
        self._add(request, ScheduledSeq(
            request.slot_idx, start, num_tokens, new_blocks, sample, num_pad_tokens
        ))  # fmt: skip
        self.budget_left -= num_tokens + num_pad_tokens
        short = sched.short_budget
        if short is not None and request.num_tokens + request.num_pending - start > short:
            self.long_pieces[request.slot_idx] = num_tokens
        sched.prefix.register(request)
        return True

    def schedule_decodes(self, requests: list[Request]) -> None:
        """One decode token for each running request, plus its proposed tokens
        where speculation pays (:mod:`.speculation`); the caller has checked that
        their new blocks for one token fit. The hot path of every step."""
        sched = self.sched
        allocate, num_needed = sched.blocks.allocate, sched.blocks.num_needed
        set_computed = sched.set_computed
        windowed = sched.blocks.window is not None
        spec = sched.speculation
        if spec is not None and (self.ahead or len(requests) > spec.max_batch):
            spec = None
        scheduled, by_slot = self.scheduled, self.requests
        # The blocks decodes fill are registered when the sequence ends or is
        # preempted (PrefixCache.release): what reuses generated tokens (a
        # chat's next turn, the sequence's own recompute) only comes after that.
        for request in requests:  # what _add does, inlined: this loop is the hot path
            pos = request.num_computed_tokens
            if windowed:
                self._free_out_of_window(request, pos)
            request_id = request.request_id  # a new block only when its last one is full:
            new_blocks = allocate(request_id, pos + 1) if num_needed(request_id, pos + 1) else ()
            if new_blocks is None:
                raise RuntimeError("schedule_decodes called without room for new blocks")
            slot_idx = request.slot_idx
            scheduled.append(ScheduledSeq(slot_idx, pos, 1, new_blocks, True, 0, (), 0))
            by_slot[slot_idx] = request
            set_computed(request, pos + 1)
            request.num_pending += 1
        self.budget_left -= len(requests)
        if spec is None:
            return
        # Proposals after every decode has its blocks: they take only what is left.
        start = len(self.scheduled) - len(requests)
        for request, entry in zip(requests, self.scheduled[start:]):
            if self.budget_left <= 0:
                break
            k, drafts = self._propose(request, entry)
            if k:
                entry.num_tokens += k
                entry.num_draft_tokens = k
                entry.draft_token_ids = drafts
                set_computed(request, entry.start_pos + entry.num_tokens)
                self.budget_left -= k
                self.num_draft_tokens += k

    def _propose(self, request: Request, entry: ScheduledSeq) -> tuple[int, list[int]]:
        """A decoding request's proposals for this step (its ``entry`` computes its
        last known token): how many, and which (prompt lookup; none named: the
        ranks' draft model proposes them), their KV blocks allocated and appended
        to the entry's; none where speculation cannot help or the blocks or the
        budget are short."""
        sched = self.sched
        spec = sched.speculation
        assert spec is not None
        params = request.params
        if not speculable(params):
            return 0, []
        pos = entry.start_pos
        # Emitting 1 + k tokens must stay within max_tokens and the context.
        k = min(spec.num_speculative_tokens, self.budget_left,
                params.max_tokens - request.num_output_tokens - 1,
                sched.max_model_len - pos - 2)  # fmt: skip
        if k <= 0:
            return 0, []
        drafts: list[int] = []
        if spec.method == "ngram":
            drafts = propose_ngram(
                request.all_token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
            if not drafts:
                return 0, []
            k = len(drafts)
        more = sched.blocks.allocate(request.request_id, pos + 1 + k)
        if more is None:
            return 0, []  # a proposal never takes blocks a preemption would have to free
        entry.new_block_ids = [*entry.new_block_ids, *more]
        return k, drafts

    def _free_out_of_window(self, request: Request, first_query: int) -> None:
        """Hands on the request's blocks that no layer reads from ``first_query`` on.
        Their KV is computed (they lie before it): registered first, caching keeps
        them, evictable, for a request with the same prefix."""
        blocks = self.sched.blocks
        if blocks.window is None:
            return
        gone = blocks_before_window(first_query, blocks.window, blocks.block_size)
        freed = blocks.num_freed.get(request.request_id, 0)
        if gone > freed:
            self.sched.prefix.register(request, gone * blocks.block_size)
            self.freed_before.setdefault(request.seq_id, freed)
        blocks.free_out_of_window(request.request_id, first_query)

    def _add(self, request: Request, entry: ScheduledSeq) -> None:
        self.scheduled.append(entry)
        self.requests[entry.slot_idx] = request
        self.sched.set_computed(request, entry.start_pos + entry.num_tokens)
        request.num_pending += entry.sample

    def pad_slot(self, slot_idx: int) -> None:
        """Computes one padding token in a slot whose sequence already ended (static)."""
        self.padding_slots.append(slot_idx)
        self.budget_left -= 1

    def drop_proposals(self) -> bool:
        """Takes every proposal back out of the step, with its budget and blocks:
        a proposal never costs a sequence its place. Returns whether any was."""
        if not self.num_draft_tokens:
            return False
        blocks = self.sched.blocks
        for entry in self.scheduled:
            if not entry.num_draft_tokens:
                continue
            request = self.requests[entry.slot_idx]
            dropped = blocks.truncate(request.request_id, entry.start_pos + 1)
            entry.new_block_ids = entry.new_block_ids[: len(entry.new_block_ids) - len(dropped)]
            self.budget_left += entry.num_draft_tokens
            entry.num_tokens = 1
            entry.num_draft_tokens = 0
            entry.draft_token_ids = ()
            self.sched.set_computed(request, entry.start_pos + 1)
        self.num_draft_tokens = 0
        return True

    def preempt(self, request: Request) -> None:
        """Frees a running request's blocks and slot; it waits to be recomputed,
        keeping every token it produced. One already scheduled in this step is
        taken back out of it."""
        if self.ahead:
            raise RuntimeError("a plan built ahead of the step in flight cannot preempt")
        if any(new.seq_id == request.seq_id for new in self.new_seqs):
            raise RuntimeError("a request admitted in this step cannot be preempted in it")
        if self.is_scheduled(request):
            entry = next(e for e in self.scheduled if e.slot_idx == request.slot_idx)
            self.scheduled.remove(entry)
            del self.requests[entry.slot_idx]
            self.budget_left += entry.num_tokens + entry.num_pad_tokens
            self.long_pieces.pop(entry.slot_idx, None)
            self.num_draft_tokens -= entry.num_draft_tokens
            # Its positions of this step are not computed after all: neither are
            # any blocks registered for them.
            self.sched.set_computed(request, entry.start_pos)
            request.num_pending -= entry.sample
        self.sched.preempt(request)
        self.preempted = True

    # -- the result ------------------------------------------------------------------

    def build(self, step: int, released_slots: list[int], now: float) -> ScheduledStep:
        plan = StepPlan(
            step=step,
            new_seqs=self.new_seqs,
            scheduled=self.scheduled,
            released_slots=released_slots,
            padding_slots=self.padding_slots,
            ahead=self.ahead,
            adapter_loads=self.sched.adapters.take_loads(),
            kv=None if self.sched.tiers is None else self.sched.tiers.take_transfers(),
        )
        self.sched.waiting.charge_step(self.requests, self.scheduled)
        return ScheduledStep(plan, self.requests, self.freed_before, now, self.num_draft_tokens)
