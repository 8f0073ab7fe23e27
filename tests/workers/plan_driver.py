"""A hand-rolled scheduler for driving a ModelRunner in tests.

Blocks come from a counter (never reused, so a wrong block table cannot hide
behind stale contents); chunk sizes and padding are whatever a test asks for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from iterserve.scheduler.blocks import blocks_before_window
from iterserve.scheduler.messages import (
    AdapterLoad,
    NewSequence,
    ScheduledSeq,
    StepPlan,
    StepResult,
)
from iterserve.scheduler.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@dataclass
class Seq:
    request_id: str
    slot: int
    tokens: list[int]
    num_prompt: int
    params: SamplingParams
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    last_start: int = 0  # where its last scheduled piece began
    finish_reason: str | None = None

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt :]


class PlanDriver:
    def __init__(self, runner, block_size: int | None = None):
        self.runner = runner
        self.block_size = block_size or runner.block_size
        # The model's window, whose out-of-reach blocks a finished sequence no longer
        # holds (a stand-in runner without a config has none).
        config = getattr(runner, "config", None)
        self.kv_window = config.kv_window if config is not None else None
        self.next_block = 0
        self.step_no = 0
        self.next_slot = 0
        self.active: dict[int, Seq] = {}
        self.done: dict[str, Seq] = {}
        self._new: list[NewSequence] = []
        self._released: list[int] = []
        self._loads: list[AdapterLoad] = []
        self.results: list[StepResult] = []

    def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams = GREEDY,
        lora_slot: int = 0,
    ) -> Seq:
        seq = Seq(request_id, self.next_slot, list(prompt), len(prompt), params)
        self.next_slot += 1
        self.active[seq.slot] = seq
        self._new.append(
            NewSequence(
                seq.slot, request_id, seq.slot, list(prompt), len(prompt), params,
                lora_slot=lora_slot,
            )
        )  # fmt: skip
        return seq

    def load_adapter(self, slot: int, adapter_id: int, path) -> None:
        """Loads an adapter into a slot with the next plan."""
        self._loads.append(AdapterLoad(slot, adapter_id, f"adapter{adapter_id}", str(path)))

    def plan(
        self,
        chunk: int | Callable[[Seq], int] = 1 << 30,
        pad_tokens: Callable[[Seq], int] | None = None,
        padding_slots: list[int] | None = None,
        only: set[int] | None = None,
    ) -> StepPlan:
        scheduled = []
        for seq in self.active.values():
            if only is not None and seq.slot not in only:
                continue
            remaining = len(seq.tokens) - seq.computed
            size = chunk(seq) if callable(chunk) else chunk
            n = min(size, remaining)
            end = seq.computed + n
            need = -(-end // self.block_size) - len(seq.blocks)
            new_blocks = list(range(self.next_block, self.next_block + max(need, 0)))
            self.next_block += len(new_blocks)
            seq.blocks += new_blocks
            seq.last_start = seq.computed
            scheduled.append(
                ScheduledSeq(
                    slot_idx=seq.slot,
                    start_pos=seq.computed,
                    num_tokens=n,
                    new_block_ids=new_blocks,
                    sample=end == len(seq.tokens),
                    num_pad_tokens=pad_tokens(seq) if pad_tokens else 0,
                )
            )
        plan = StepPlan(
            step=self.step_no,
            new_seqs=self._new,
            scheduled=scheduled,
            released_slots=self._released,
            padding_slots=list(padding_slots or []),
            adapter_loads=self._loads,
        )
        self._new, self._released, self._loads = [], [], []
        self.step_no += 1
        return plan

    def step(self, **kwargs) -> StepResult:
        plan = self.plan(**kwargs)
        result = self.runner.execute(plan)
        by_seq = dict(self.active)  # a sequence's seq_id is its slot here
        for entry in plan.scheduled:
            self.active[entry.slot_idx].computed += entry.num_tokens
        for tok in result.sampled:
            by_seq[tok.seq_id].tokens.append(tok.token_id)
        for fin in result.finished:
            seq = by_seq[fin.seq_id]
            # Blocks out of every layer's window were handed on before the end.
            gone = blocks_before_window(seq.last_start, self.kv_window, self.block_size)
            assert fin.block_ids == seq.blocks[gone:]
            seq.finish_reason = fin.reason
            del self.active[seq.slot]
            self._released.append(seq.slot)
            self.done[seq.request_id] = seq
        self.results.append(result)
        return result

    def run(self, max_steps: int = 10_000, **kwargs) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.active:
                break
            self.step(**kwargs)
        assert not self.active, "sequences still running"
        return {rid: seq.output for rid, seq in self.done.items()}
