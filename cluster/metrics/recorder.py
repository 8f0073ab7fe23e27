"""Turns the engine's events into metrics: per-step figures and per-request latencies.

The scheduler actor calls this once per step and once per published output;
every timestamp is ``time.monotonic()`` taken in the scheduler actor, so queue,
prefill and decode times are measured on the iteration clock's own process.
The times of a request are kept on the request itself (``Request.arrival_time``,
``scheduled_time``, ``first_token_time``, ``last_token_time``): the engine's
one table of its requests is the scheduler's.
"""

from __future__ import annotations

import time
from collections import deque

from ...scheduler import (
    FinishReason,
    Request,
    RequestOutput,
    ScheduledStep,
    Scheduler,
    StepResult,
)
from ...scheduler.speculation import SpeculationStats
from .engine import EngineMetrics
from .tenants import TenantMetrics

RECENT_TTFT = 256  # first tokens the autoscaler's TTFT signal remembers


class MetricsRecorder:
    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics
        self._num_preemptions = 0
        self._num_recomputed = 0
        self._prefix = (0, 0, 0)  # queries, hits, evictions recorded so far
        # (when, seconds) of recent first tokens: the autoscaler's TTFT signal
        self.recent_ttft: deque[tuple[float, float]] = deque(maxlen=RECENT_TTFT)
        self._lora = (0, 0)  # adapter loads and evictions recorded so far
        self._spec: SpeculationStats | None = None  # the speculation counters recorded so far
        self.tenants = TenantMetrics(metrics)

    def admitted(self, request: Request) -> None:
        self.metrics.on_prompt(request.num_prompt_tokens)

    def rejected(self, reason: str) -> None:
        self.metrics.on_rejected(reason)

    def rank_restart(self) -> None:
        self.metrics.on_rank_restart()

    def step(
        self, step: ScheduledStep, result: StepResult, step_s: float, sched: Scheduler
    ) -> None:
        plan = step.plan
        # The ranks' counts: a plan built ahead may name sequences the step before
        # it ended, whose decodes the ranks computed as padding.
        ended = plan.num_tokens - result.num_tokens
        # A decode row computes one token, or one plus its proposals.
        decode = sum(s.num_tokens for s in plan.scheduled
                     if s.sample and (s.num_tokens == 1 or s.num_draft_tokens)) - ended  # fmt: skip
        self.metrics.observe_step(
            duration_s=step_s,
            forward_s=result.forward_s,
            built_ahead=plan.ahead,
            num_prefill_tokens=result.num_tokens - decode,
            num_decode_tokens=decode,
            num_padding_tokens=result.num_padding_tokens,
            num_running=len(sched.running),
            max_num_seqs=sched.config.max_num_seqs,
        )
        self.state(sched)
        self.tenants.flush(sched)
        preempted = sched.num_preemptions - self._num_preemptions
        recomputed = sched.num_recomputed_tokens - self._num_recomputed
        if preempted or recomputed:
            self.metrics.on_preemptions(preempted, recomputed)
            self._num_preemptions = sched.num_preemptions
            self._num_recomputed = sched.num_recomputed_tokens
        prefix = (sched.num_prefix_queries, sched.num_prefix_hits, sched.blocks.num_evictions)
        if prefix != self._prefix:
            queries, hits, evictions = (now - before for now, before in zip(prefix, self._prefix))
            self.metrics.on_prefix_cache(queries=queries, hits=hits, evictions=evictions)
            self._prefix = prefix
        if step.num_draft_tokens and sched.spec_stats is not None:
            self.speculation(sched)

    def speculation(self, sched: Scheduler) -> None:
        """What became of the proposals verified since the last call."""
        stats = sched.spec_stats
        assert stats is not None
        delta = stats.since(self._spec)
        self.metrics.on_speculation(
            drafts=delta.num_drafts,
            draft_tokens=delta.num_draft_tokens,
            accepted=delta.num_accepted_tokens,
            emitted=delta.num_emitted_tokens,
            accepted_per_pos=delta.accepted_per_pos,
            lengths=delta.acceptance_lengths,
        )
        self._spec = stats.since(None)

    def adapters(self, sched: Scheduler) -> None:
        """LoRA adapters' residency and their requests (a no-op with none loaded)."""
        residency = sched.adapters
        if not residency.registered and not residency.num_loads:
            return
        running = dict.fromkeys(residency.registered, 0)
        waiting: dict[str, int] = {}
        for request in sched.requests.values():
            if request.lora_name in running:
                counts = running if request.slot_idx >= 0 else waiting
                counts[request.lora_name] = counts.get(request.lora_name, 0) + 1
        loads, evictions = residency.num_loads, residency.num_evictions
        self.metrics.set_lora(resident=residency.num_resident, loads=loads - self._lora[0],
                              evictions=evictions - self._lora[1], running=running,
                              waiting=waiting)  # fmt: skip
        self._lora = (loads, evictions)

    def state(self, sched: Scheduler) -> None:
        self.adapters(sched)
        stats = sched.stats()
        self.metrics.set_state(
            num_running=stats["num_running"],
            num_waiting=stats["num_waiting"],
            num_preempted=stats["num_preempted"],
            slots_used=stats["slots_used"],
            slots_total=stats["slots_total"],
            kv_blocks_used=stats["kv_blocks_used"],
            kv_blocks_total=stats["kv_blocks_total"],
            kv_blocks_cached=stats["kv_blocks_cached"],
        )

    def outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            request = out.request
            if request is None:
                continue
            n = len(out.new_token_ids)
            if n:
                itl = []
                served = n
                if request.first_token_time is None:
                    arrival = request.arrival_time
                    scheduled = request.scheduled_time or arrival
                    self.metrics.on_first_token(
                        queue_s=scheduled - arrival, prefill_s=now - scheduled, ttft_s=now - arrival
                    )
                    self.tenants.first_token(request, now - arrival, now)
                    request.first_token_time = now
                    self.recent_ttft.append((now, now - arrival))
                    served += request.num_prompt_tokens - (request.num_cached_tokens or 0)
                else:
                    itl = [(now - request.last_token_time) / n] * n
                request.last_token_time = now
                self.metrics.on_tokens(n, itl)
                self.tenants.served(request.tenant, served)
            if out.finish_reason is not None:
                self.finished(request, out.finish_reason)

    def finished(self, request: Request, reason: FinishReason) -> None:
        now = time.monotonic()
        num_tokens = request.num_output_tokens
        first = request.first_token_time
        decode_s = now - first if first is not None else 0.0
        tpot = decode_s / (num_tokens - 1) if num_tokens > 1 and first is not None else None
        self.metrics.on_finish(
            reason=reason.category, e2e_s=now - request.arrival_time, decode_s=decode_s, tpot_s=tpot
        )
