"""The iteration-level scheduler.

:meth:`Scheduler.schedule` decides which sequences run in the next iteration
and how many tokens each computes, and returns the :class:`ScheduledStep`,
which it keeps in its queue of steps in flight; :meth:`Scheduler.update` takes
the ranks' :class:`StepResult` and pairs it with the oldest of them. The
batching *policy* (static, dynamic, continuous, chunked) only chooses, into a
:class:`StepBuilder` made for that one call; this module owns the slot table,
the KV block manager, the waiting queue, the steps in flight, preemption and
finishing.

Scheduling ahead (``ahead``; the engine's ``async_scheduling``): while step N
runs, ``schedule`` may build step N+1, so the ranks start N+1 as soon as N
ends instead of waiting for the scheduler to take N's result and decide. What
N will produce is not known yet, so a plan built ahead rests on what is certain:

- every sequence N samples for is counted as one token longer (its token is
  *pending*); the ranks hold that token and feed it to N+1 themselves;
- a sequence whose last token (``max_tokens``) N samples is *released ahead*:
  its slot and blocks go to waiting requests in N+1, and it finishes when N's
  result brings that token (``released_ahead``);
- a sequence N ends by EOS or a stop token still gets a row in N+1, which the
  ranks compute as padding (the cost of not knowing: one row, once);
- a plan that would have to preempt, or whose sequences would propose tokens,
  is not built ahead: ``schedule`` returns None and the caller schedules again
  once N's result is in.

Prefix caching (which blocks are shared by content, and when) is explained in
:mod:`~iterserve.scheduler.prefix_cache`; the tiers below the device (host
memory, disk), preemption by swap and the KV events in :mod:`~iterserve.scheduler.kv_tiers`.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from .adapters import AdapterResidency
from .blocks import BlockManager
from .config import SchedulerConfig
from .errors import PromptTooLongError, ProtocolError
from .kv_tiers import KVTiers, TierConfig
from .messages import MAX_TENANT_LEN, NewSequence, StepResult
from .policies import make_policy
from .prefix_cache import PrefixCache
from .queue import make_queue
from .request import (
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
)
from .slots import SlotTable
from .speculation import SpeculationStats, speculable
from .step import ScheduledStep, StepBuilder


class Scheduler:
    """``ahead``: whether a step may be built while the one before it runs (then
    two are in flight at most; else one at a time). ``kv_window``: the model's,
    when every layer reads only that many last positions (blocks before it are
    handed on while a sequence runs; paged only). ``tiers``: the KV tiers below the
    device and the events (with prefix caching only; None: neither)."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        ahead: bool = True,
        kv_window: int | None = None,
        tiers: TierConfig | None = None,
        short_budget: int | None = None,
    ):
        config.check_complete()
        self.config = config
        self.ahead = ahead
        # What a step spends on decodes and short prompts (SchedulerConfig.short_budget);
        # None: all of the token budget.
        self.short_budget = short_budget
        self.slots = SlotTable(config.max_num_seqs)
        num_kv_blocks, max_model_len = config.num_kv_blocks, config.max_model_len
        assert num_kv_blocks is not None and max_model_len is not None  # check_complete
        self.max_model_len = max_model_len
        slab = max_model_len if config.kv_layout == "slab" else 0
        window = kv_window if config.kv_layout == "paged" else None
        self.blocks = BlockManager(num_kv_blocks, config.block_size, slab_tokens=slab,
                                   window=window)  # fmt: skip
        self.prefix_caching = config.prefix_caching
        self.prefix = PrefixCache(self.blocks, config.block_size, config.prefix_caching)
        self.tiers: KVTiers | None = None
        if tiers is not None and config.prefix_caching:
            self.tiers = KVTiers(tiers, config.block_size, self.blocks.cached)
            self.blocks.tiers = self.tiers
        self.running: dict[str, Request] = {}
        # Who waits, in the order of scheduling_policy (and, under fair, whose turn it is).
        self.waiting = make_queue(config, self.running)
        self.requests: dict[str, Request] = {}
        self.policy = make_policy(config)
        # LoRA adapters: the registry and which the ranks hold (a resource like slots).
        self.adapters = AdapterResidency(config.max_loras)
        # Speculative decoding (None: off): proposals and what became of them.
        self.speculation = config.speculation
        self.spec_stats = (
            SpeculationStats(self.speculation.num_speculative_tokens) if self.speculation else None
        )
        self.step = 0
        # The steps handed out whose results have not come back, oldest first: the
        # one queue of them (the engine keeps none); update() pairs a result with
        # the oldest.
        self._in_flight: deque[ScheduledStep] = deque()
        self._next_seq_id = 0
        # The requests the ranks know, by the id results name them with: running
        # ones and those released ahead. An aborted request leaves at once, so a
        # result computed for it is dropped even when a new request reuses its id.
        self._by_seq: dict[int, Request] = {}
        # Requests whose last token a step in flight samples, their slot and blocks
        # handed on ahead of it: seq_id -> (request, the blocks it held, for the
        # ranks' check).
        self.released_ahead: dict[int, tuple[Request, list[int]]] = {}
        self._released_slots: list[int] = []  # since the last plan: the next one says so
        self.num_preempted = 0  # waiting requests whose KV was dropped
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_prefix_queries = 0  # tokens of admitted sequences looked up in the cache
        self.num_prefix_hits = 0  # of those, tokens found cached

    # -- admission and abort -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request. Raises QueueFullError, PromptTooLongError,
        SamplingParamsError or ValueError; a refused request leaves no trace."""
        if type(request.priority) is not int:  # the queue orders by it: refuse before any trace
            raise ValueError(f"priority: must be an integer, got {type(request.priority).__name__}")
        if type(request.tenant) is not str or not 0 < len(request.tenant) <= MAX_TENANT_LEN:
            raise ValueError(f"tenant: must be a string of 1 to {MAX_TENANT_LEN} characters")
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty; at least one token is required")
        if request.num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(request.num_prompt_tokens, self.max_model_len)
        request.params.check_limits(max_n=self.config.max_n, max_logprobs=self.config.max_logprobs)
        if request.lora_name is not None:  # raises AdapterNotFoundError
            request.adapter = self.adapters.get(request.lora_name)
            request.cache_salt = request.adapter.cache_salt + request.cache_salt
        self.waiting.check_room(request)  # raises QueueFullError
        room = self.max_model_len - request.num_prompt_tokens
        if request.params.max_tokens > room:
            request.params = dataclasses.replace(
                request.params,
                max_tokens=room,
                min_tokens=min(request.params.min_tokens, room),
            )
        if request.ttft_deadline is None:  # the tenant's target, if it has one
            slo_ms = self.config.tenants.get(request.tenant, {}).get("ttft_slo_ms")
            if slo_ms is not None:
                request.ttft_deadline = request.arrival_time + slo_ms / 1000
        request.status = RequestStatus.WAITING
        request.seq_id = self._next_seq_id
        self._next_seq_id += 1
        self.requests[request.request_id] = request
        self.waiting.push(request)
        if self.tiers is not None and self.prefix.hit_allowed(request):
            hashes = request.full_block_hashes(self.config.block_size)
            self.tiers.prefetch(
                request, hashes[: (request.num_tokens - 1) // self.config.block_size]
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request in any state; its slot and blocks are free for the next step."""
        return self._end(request_id, FinishReason.ABORT)

    def finish_with_error(self, request_id: str) -> RequestOutput | None:
        """Ends a request because the engine cannot serve it (ranks lost)."""
        return self._end(request_id, FinishReason.ERROR)

    def _end(self, request_id: str, reason: FinishReason) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.request_id in self.waiting:
            self.waiting.remove(request.request_id)
        if self.tiers is not None:
            self.tiers.forget(request_id)
        self._finish(request, reason)
        return RequestOutput(request_id, finish_reason=reason, request=request)

    def requeue_running(self) -> None:
        """The steps in flight were lost with the ranks: forget them and preempt
        every running sequence, to be recomputed on fresh ranks. No token is lost."""
        self.drop_in_flight()
        for request in self.policy.reset():
            self.release_slot(request, tell_ranks=False)  # the ranks are gone
        ahead = [request for request, _ in self.released_ahead.values()]
        self.released_ahead.clear()
        for request in sorted([*self.running.values(), *ahead], key=Request.sort_key):
            self.preempt(request, kv_lost=True)
        self.blocks.clear_cache()  # the KV every hash named died with the ranks
        if self.tiers is not None:
            self.tiers.ranks_lost()  # and their host memory with them
        self.adapters.forget_resident()  # and so did the adapters they held

    def reset_prefix_cache(self, external: bool = False, preempt_running: bool = False) -> bool:
        """Forgets every cached block's hash (``external``: the host and disk tiers'
        too). False, changing nothing, while requests hold blocks (vLLM's answer),
        unless ``preempt_running`` preempts them first (no step may be in flight)."""
        if not self.prefix_caching:
            return True  # nothing is cached
        if self._in_flight or self.released_ahead:
            return False
        if self.running and not preempt_running:
            return False
        for request in sorted(self.running.values(), key=Request.sort_key, reverse=True):
            self.preempt(request)
        self.blocks.clear_cache()
        if external and self.tiers is not None:
            self.tiers.clear()
        return True

    def drop_in_flight(self) -> None:
        """Forgets the steps in flight: their results will never come (the ranks
        were lost, or the engine stops serving)."""
        self._in_flight.clear()

    # -- the step --------------------------------------------------------------

    def schedule(self, now: float) -> ScheduledStep | None:
        """Builds the next step and keeps it in the queue of steps in flight, or
        returns None when there is nothing to run or no room in that queue.

        With a step in flight, builds the step after it (built ahead, see the
        module docstring), or returns None when that step must wait for the
        result of the one in flight."""
        in_flight = self._in_flight
        finishing: list[Request] = []
        if in_flight:
            if not self.ahead or len(in_flight) > 1:
                return None
            if in_flight[-1].num_draft_tokens or self._speculates_next():
                # How many tokens a draft adds is known only from its result; and a plan
                # built ahead proposes nothing: where proposals pay, they beat the overlap.
                return None
            fits = self._finishing_if_ahead_fits()
            if fits is None:
                return None
            finishing = fits
        for request in self.policy.ended_batch():  # an abort may have ended it
            self.release_slot(request, tell_ranks=False)
        step = StepBuilder(self, ahead=bool(in_flight))
        if finishing and not self.policy.holds_finished_slots:
            self._release_ahead(finishing)
        self.policy.schedule(step, now)
        if not step.scheduled and not self._tiers_busy(in_flight):
            return None
        for new in step.new_seqs:
            request = step.requests[new.slot_idx]
            if request.scheduled_time is None:
                request.scheduled_time = now
        self.step += 1
        scheduled = step.build(self.step, self._released_slots, now)
        self._released_slots = []
        in_flight.append(scheduled)
        return scheduled

    def _tiers_busy(self, in_flight: deque[ScheduledStep]) -> bool:
        """Whether a step without rows should still go, for the tiers: it carries
        transfers, or collects the reports of disk reads (one at a time)."""
        tiers = self.tiers
        return tiers is not None and tiers.busy and not in_flight

    def _finishing_if_ahead_fits(self) -> list[Request] | None:
        """The running sequences whose last token the step in flight samples; None
        unless every other one's next step, at its largest, fits in the free blocks
        (otherwise a choice in a plan built ahead could need a preemption)."""
        budget = self.config.token_budget
        num_needed = self.blocks.num_needed
        needed = 0
        finishing = []
        for request in self.running.values():
            if request.finishes_in_flight:
                finishing.append(request)  # released ahead (or padding, in static batching)
                continue
            target = request.num_computed_tokens + min(request.num_remaining_tokens, budget)
            needed += num_needed(request.request_id, target)
        return finishing if needed <= self.blocks.num_free else None

    def _release_ahead(self, finishing: list[Request]) -> None:
        """Hands on the slot and blocks of every sequence whose last token the step
        in flight samples. The ranks drop it when they sample that token, before
        they start the step being built, so the step may reuse both."""
        for request in finishing:
            # Its KV up to its last known token is computed by the step in flight.
            known = min(request.num_computed_tokens, request.num_tokens)
            self.released_ahead[request.seq_id] = (request, self.prefix.release(request, known))
            self.release_slot(request, tell_ranks=False)
            del self.running[request.request_id]
            # The step in flight computes its last row with its adapter; a load that
            # reuses the slot travels in a later plan, applied after that step.
            self.unpin_adapter(request)

    def update(self, result: StepResult) -> ScheduledStep:
        """Pairs the ranks' result with the oldest step in flight and applies it:
        append tokens, finish, free. Returns that step, taken out of the queue,
        with what it produced for each request (``outputs``)."""
        in_flight = self._in_flight
        if not in_flight:
            raise ProtocolError(f"a result for step {result.step}, but no step is in flight")
        step = in_flight[0]
        if result.step != step.plan.step:
            raise ProtocolError(f"result for step {result.step}, expected {step.plan.step}")
        in_flight.popleft()
        if result.kv is not None and self.tiers is not None:
            self.tiers.on_report(result.kv)
        running = RequestStatus.RUNNING
        requests = step.requests
        expected: list[Request] = []
        for entry in step.plan.scheduled:
            if entry.sample:
                request = requests[entry.slot_idx]
                if request.status == running:  # not aborted meanwhile
                    request.num_pending -= 1
                    expected.append(request)
        outputs: dict[str, RequestOutput] = {}
        live = self._by_seq
        at_limit: list[Request] = []  # requests this step took to max_tokens
        for sampled in result.sampled:
            req = live.get(sampled.seq_id)
            if req is None:
                continue  # aborted while the step was in flight
            tokens = req.output_token_ids
            tokens.append(sampled.token_id)
            out = outputs.get(req.request_id)
            if out is not None:  # a second token: a draft's accepted run
                out.new_token_ids.append(sampled.token_id)
            else:
                out = outputs[req.request_id] = RequestOutput(
                    req.request_id, [sampled.token_id], request=req
                )
                if len(tokens) == 1:
                    out.num_cached_tokens = req.num_cached_tokens
            if len(tokens) >= req.params.max_tokens:
                at_limit.append(req)
            if req.params.logprobs is not None:
                logprobs = (sampled.logprob, list(sampled.top_logprobs))
                req.output_logprobs.append(logprobs)
                if isinstance(out.new_logprobs, list):
                    out.new_logprobs.append(logprobs)
                else:
                    out.new_logprobs = [logprobs]
        for prompt in result.prompt_logprobs:  # once, with the step completing the prompt
            req = live.get(prompt.seq_id)
            if req is not None:
                out = outputs.setdefault(req.request_id, RequestOutput(req.request_id, request=req))
                out.prompt_logprobs = prompt
        for pooled in result.pooled:  # a pooling engine's, with the step that finishes it
            req = live.get(pooled.seq_id)
            if req is not None:
                out = outputs.setdefault(req.request_id, RequestOutput(req.request_id, request=req))
                out.pooled = pooled.data
        for finished in result.finished:
            req = live.get(finished.seq_id)
            if req is None:
                continue  # aborted while the step was in flight
            ahead = self.released_ahead.get(finished.seq_id)
            held = ahead[1] if ahead is not None else self._held_after(step, req)
            if list(finished.block_ids) != held:
                raise ProtocolError(
                    f"{req.request_id}: a rank released blocks "
                    f"{finished.block_ids}, scheduler holds {held}"
                )
            reason = FinishReason(finished.reason)
            self._finish(req, reason)
            outputs.setdefault(
                req.request_id, RequestOutput(req.request_id, request=req)
            ).finish_reason = reason
        if step.num_draft_tokens:
            self._settle_drafts(step, outputs)
        for request in expected:
            if request.request_id not in outputs:
                raise ProtocolError(
                    f"{request.request_id}: no token sampled in step {step.plan.step}"
                )
        for request in at_limit:
            if request.status == running:
                raise ProtocolError(f"{request.request_id}: reached max_tokens unfinished")
        for request in self.policy.ended_batch():
            self.release_slot(request, tell_ranks=False)  # ended on the rank
        step.outputs = list(outputs.values())
        return step

    def _held_after(self, step: ScheduledStep, request: Request) -> list[int]:
        """The blocks ``request`` held once the ranks applied ``step``: what they
        release if it ends in it. The step built ahead of its result (still in
        flight) may have grown its table since, or handed on blocks out of its
        window: those changes are taken back out."""
        table = self.blocks.table(request.request_id)
        end = len(table)
        first = self.blocks.num_freed.get(request.request_id, 0)
        for later in self._in_flight:
            entry = later.entry_of(request)
            if entry is not None:
                end -= len(entry.new_block_ids)
            first = later.freed_before.get(request.seq_id, first)
        return table[first:end]

    def _speculates_next(self) -> bool:
        """Whether the next step, built after the result in flight, would propose:
        few enough sequences running, one of them able to speculate."""
        spec = self.speculation
        if spec is None or len(self.running) > spec.max_batch:
            return False
        return any(speculable(request.params) for request in self.running.values())

    def _settle_drafts(self, step: ScheduledStep, outputs: dict[str, RequestOutput]) -> None:
        """Counts each draft's fate and, for a sequence still running, takes back the
        positions its rejected proposals held, blocks included: the rule the
        ranks apply to their own tables (``SequenceTable.take_drafts``)."""
        stats = self.spec_stats
        assert stats is not None
        for entry in step.plan.scheduled:
            if not entry.num_draft_tokens:
                continue
            request = step.requests[entry.slot_idx]
            out = outputs.get(request.request_id)
            if out is None:
                continue  # aborted while the step was in flight
            emitted = len(out.new_token_ids)
            stats.record(entry.num_draft_tokens, emitted)
            if request.status != RequestStatus.RUNNING:
                continue  # it ended in this step and released every block it held
            # Its positions up to the last emitted token's are computed, that one's is not.
            self.set_computed(request, entry.start_pos + emitted)
            self.blocks.truncate(request.request_id, request.num_computed_tokens)

    # -- what the step builder and the policies call ----------------------------------

    def admit(self, request: Request, num_cached_tokens: int = 0) -> NewSequence:
        """Gives a waiting request a slot, its first ``num_cached_tokens`` found in the
        prefix cache; the ranks learn of it from the plan."""
        if request.request_id in self.waiting:
            self.waiting.remove(request.request_id)
        if request.status == RequestStatus.PREEMPTED:
            self.num_preempted -= 1
            self.num_recomputed_tokens += max(0, request.num_dropped_tokens - num_cached_tokens)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached_tokens
        if self.prefix_caching:
            self.num_prefix_queries += request.num_tokens
            self.num_prefix_hits += num_cached_tokens
        request.slot_idx = self.slots.acquire(request.request_id)
        if request.adapter is not None:
            slot = self.adapters.pin(request.adapter)
            assert slot is not None, "admitted without room for its adapter (StepBuilder checks)"
            request.lora_slot = slot
        request.status = RequestStatus.RUNNING
        self.running[request.request_id] = request
        self._by_seq[request.seq_id] = request
        return NewSequence(
            seq_id=request.seq_id,
            label=request.label,
            slot_idx=request.slot_idx,
            token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            params=request.params,
            num_cached_tokens=num_cached_tokens,
            lora_slot=request.lora_slot,
        )

    def unpin_adapter(self, request: Request) -> None:
        """A request leaves the running set: its adapter's slot may be reused."""
        if request.adapter is not None and request.lora_slot:
            self.adapters.unpin(request.adapter.adapter_id)
            request.lora_slot = 0

    def preempt(self, request: Request, *, kv_lost: bool = False) -> None:
        """Frees a running request's blocks and slot; it re-enters the queue keeping
        every token it produced, to be recomputed later, from its blocks still
        cached by then. Never while a step is in flight, except to forget the lost
        steps of failed ranks (``kv_lost``: nothing they computed is kept)."""
        if kv_lost:
            self.blocks.free(request.request_id)
        else:  # nothing is in flight: every planned position is computed
            self.prefix.release(request, min(request.num_computed_tokens, request.num_tokens))
        del self._by_seq[request.seq_id]
        if request.slot_idx >= 0:  # one released ahead has handed its slot on
            self.release_slot(request, tell_ranks=True)
            del self.running[request.request_id]
            self.unpin_adapter(request)
        request.num_dropped_tokens = request.num_computed_tokens
        self.set_computed(request, 0)
        request.num_pending = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preempted += 1
        self.waiting.push(request)

    @staticmethod
    def set_computed(request: Request, num_tokens: int) -> None:
        """The one place a request's computed position moves: forward as a step is
        built (the positions it plans count as computed), back when planned
        positions turn out not to be (proposals dropped or rejected, an entry
        taken back out of its step, a preemption). The caller keeps its blocks
        in step with it."""
        request.num_computed_tokens = num_tokens

    def release_slot(self, request: Request, *, tell_ranks: bool) -> None:
        """Frees a request's slot, the one place slots are freed. ``tell_ranks``:
        the next plan releases it (an abort, an error, a preemption: the ranks
        still hold the sequence); otherwise they dropped it themselves (it ended
        where it was sampled, or its last token is being sampled: released ahead)."""
        self.slots.release(request.slot_idx)
        if tell_ranks:
            self._released_slots.append(request.slot_idx)
        request.slot_idx = -1

    def _finish(self, request: Request, reason: FinishReason) -> None:
        was = request.status
        request.status = reason.status
        request.finish_reason = reason
        del self.requests[request.request_id]
        if was == RequestStatus.PREEMPTED:
            self.num_preempted -= 1
        self._by_seq.pop(request.seq_id, None)
        if self.released_ahead.pop(request.seq_id, None) is not None:
            return  # slot and blocks were handed on ahead of its last token
        if reason == FinishReason.ERROR:
            self.blocks.free(request.request_id)  # the ranks' state is not trusted
        else:
            # The KV of every known token is computed, or will be by a step already
            # planned, except that of a last sampled token: that is never computed
            # (a prompt-only request, max_tokens 0, sampled none).
            sampled_last = reason != FinishReason.ABORT and request.num_output_tokens > 0
            known = request.num_tokens - sampled_last
            self.prefix.release(request, min(request.num_computed_tokens, known))
        if was != RequestStatus.RUNNING:
            return
        del self.running[request.request_id]
        self.unpin_adapter(request)
        if reason in (FinishReason.ABORT, FinishReason.ERROR):
            self.release_slot(request, tell_ranks=True)  # the ranks still hold it
        elif not self.policy.holds_finished_slots:
            self.release_slot(request, tell_ranks=False)  # the rank ended it itself
        # else: static batching keeps the slot, as padding, until its batch ends.

    # -- introspection ---------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Steps handed out whose results have not come back."""
        return len(self._in_flight)

    @property
    def has_work(self) -> bool:
        return (
            bool(self.running)
            or bool(self.released_ahead)
            or len(self.waiting) > 0
            or (self.tiers is not None and self.tiers.busy)
        )

    def next_deadline(self) -> float | None:
        """When a waiting-but-unlaunched batch must launch (static/dynamic), if any."""
        return self.policy.next_deadline(self.waiting)

    def stats(self) -> dict:
        """The scheduler's state, from counts kept up to date as it changes."""
        return {
            "policy": self.config.policy,
            "scheduling_policy": self.config.scheduling_policy,
            "max_num_batched_tokens": self.config.token_budget,
            "step": self.step,
            "num_running": len(self.running) + len(self.released_ahead),
            "num_waiting": len(self.waiting),
            "num_preempted": self.num_preempted,
            "slots_used": self.slots.num_used,
            "slots_total": self.slots.num_slots,
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_usage": self.blocks.usage,
            "num_preemptions": self.num_preemptions,
            "num_recomputed_tokens": self.num_recomputed_tokens,
            "prefix_caching": self.prefix_caching,
            "kv_blocks_cached": self.blocks.num_cached,
            "prefix_cache_queries": self.num_prefix_queries,
            "prefix_cache_hits": self.num_prefix_hits,
            "prefix_cache_evictions": self.blocks.num_evictions,
            **(self.spec_stats.as_dict() if self.spec_stats is not None else {}),
            **(self.tiers.stats() if self.tiers is not None else {}),
        }

    def tenant_stats(self) -> dict[str, dict]:
        """Per tenant: its requests waiting and running and, under ``fair``, its
        counter of tokens served (weighted). A scan of every request: for
        ``/v1/stats`` and a metrics refresh, not for every step."""
        tenants: dict[str, dict] = {}
        for request in self.requests.values():
            counts = tenants.setdefault(request.tenant, {"waiting": 0, "running": 0})
            counts["running" if request.status == RequestStatus.RUNNING else "waiting"] += 1
        for name, counter in self.waiting.counters().items():
            tenants.setdefault(name, {"waiting": 0, "running": 0})["served"] = round(counter, 3)
        return tenants

    def check_integrity(self) -> None:
        """Slots, blocks and counts are consistent with the requests that hold them;
        the waiting queue (per tenant, under ``fair``) with the requests that wait."""
        self.slots.check_integrity()
        self.waiting.check_integrity(self.requests)
        self.blocks.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        for request_id in self.blocks.tables:
            assert request_id in self.running, f"{request_id} holds blocks but is not running"
        for request in self.running.values():
            assert self.slots.owner(request.slot_idx) == request.request_id, "slot owner mismatch"
            assert request.status == RequestStatus.RUNNING
            self.prefix.check_request(request)
        ahead = [request for request, _ in self.released_ahead.values()]
        for request in ahead:
            assert request.status == RequestStatus.RUNNING and request.slot_idx < 0
        live = [*self.running.values(), *ahead]
        assert {r.seq_id: r for r in live} == self._by_seq, "live sequences mismatch"
        pins: dict[int, int] = {}
        for request in self.running.values():
            if request.adapter is not None:
                aid = request.adapter.adapter_id
                pins[aid] = pins.get(aid, 0) + 1
                assert self.adapters.slot_of[aid] == request.lora_slot, "adapter slot mismatch"
        self.adapters.check_integrity(pins)
        counted = len(self.waiting) + len(self.running) + len(ahead)
        assert counted == len(self.requests), "requests lost"
        preempted = sum(r.status == RequestStatus.PREEMPTED for r in self.requests.values())
        assert preempted == self.num_preempted, "preempted count mismatch"
