"""Runs of one model under different batches, each row's logits recorded, for the
batch-invariance tests (test_batch_invariant.py, the TP worker, the device check's
section reads the same idea): a request alone, whole prompt then one decode row a
step, against the same request among others, its prompt cut into pieces of any
size, preempted and recomputed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from plan_driver import PlanDriver, Seq

from iterserve.scheduler.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def params_for(label: str) -> SamplingParams:
    """Every other request samples at temperature 1 with a seed of its own."""
    if sum(map(ord, label)) % 2:
        return GREEDY
    return SamplingParams(temperature=1.0, seed=sum(map(ord, label)), max_tokens=6,
                          ignore_eos=True)  # fmt: skip


# Prompt lengths around the kernels' edges: one row, a block of 16, a piece the
# default mode would send to the long-piece kernels (8192 work / 4 heads), more.
LENGTHS = [1, 2, 7, 16, 17, 33, 64, 65, 100, 150, 257]


def prompt_pool(vocab: int, count: int = 64, seed: int = 0) -> dict[str, list[int]]:
    """:data:`LENGTHS`' prompts, then short ones (1-48 tokens) up to ``count``."""
    rng = random.Random(seed)
    lengths = LENGTHS + [rng.randrange(1, 49) for _ in range(count - len(LENGTHS))]
    return {f"p{i}-{n}": [rng.randrange(1, vocab) for _ in range(n)] for i, n in enumerate(lengths)}


def record_logits(runner) -> dict[str, dict[int, list[torch.Tensor]]]:
    """From now on, every sampled row's logits: ``log[label][position]``, the
    position whose token they choose (twice where a recompute chose it again)."""
    log: dict[str, dict[int, list[torch.Tensor]]] = {}
    sample = type(runner)._sample.__get__(runner)  # the runner's own, not a recording

    def recording(logits, entries, result):
        row = 0
        for entry in entries:
            label = runner.table.get(entry.slot_idx).label
            position = entry.start_pos + entry.num_tokens
            log.setdefault(label, {}).setdefault(position, []).append(logits[row].clone())
            row += 1 + entry.num_draft_tokens
        return sample(logits, entries, result)

    runner._sample = recording
    return log


def alone(runner, prompts: dict[str, list[int]]):
    """Each request on its own, its prompt in one piece, then its decode rows: the
    logits recorded and each request's tokens."""
    log, outputs = record_logits(runner), {}
    for label, prompt in prompts.items():
        driver = PlanDriver(runner)
        driver.add(label, prompt, params_for(label))
        outputs.update(driver.run())
    return log, outputs


@dataclass
class Scenario:
    """A batch run: when each request arrives, which active sequences a step takes
    (the others wait, as under a token budget), how long each one's piece is, and
    which sequences are preempted (they leave with their tokens and come back)."""

    arrivals: dict[str, int]  # label -> the step it arrives at
    steps: list[tuple[float, list[int], float]] = field(default_factory=list)
    # per step: share of active sequences taken, piece sizes to draw from, preemption chance
    seed: int = 0


def run(runner, prompts: dict[str, list[int]], scenario: Scenario):
    """The requests of ``scenario`` through ``runner``: the logits recorded, each
    request's tokens, and what the run saw (preemptions, the most rows a step, the
    steps that mixed decode rows and prefill pieces)."""
    log = record_logits(runner)
    driver = PlanDriver(runner)
    try:
        stats = _steps(driver, prompts, scenario)
    finally:  # whatever failed, the runner holds none of these sequences afterwards
        for slot in list(driver.active):
            del driver.active[slot]
            driver._released.append(slot)
        runner.execute(driver.plan(only=set()))
    return log, {label: seq.output for label, seq in driver.done.items()}, stats


def _steps(driver: PlanDriver, prompts, scenario: Scenario) -> dict:
    rng = random.Random(scenario.seed)
    pending = sorted(scenario.arrivals.items(), key=lambda kv: kv[1])
    stats = {"preemptions": 0, "widest_step": 0, "mixed_steps": 0}
    preempted: dict[str, int] = {}
    step = 0
    while pending or driver.active:
        while pending and pending[0][1] <= step:
            label, _ = pending.pop(0)
            driver.add(label, prompts[label], params_for(label))
        share, sizes, preempt = (
            scenario.steps[step % len(scenario.steps)] if scenario.steps else (1.0, [1 << 30], 0.0)
        )
        step += 1
        if not driver.active:
            continue
        seqs = list(driver.active.values())
        # as the scheduler does: a running sequence (its prompt in), each a few times at most
        running = [
            s for s in seqs if s.computed >= s.num_prompt and preempted.get(s.request_id, 0) < 2
        ]
        if running and preempt and rng.random() < preempt:
            gone = rng.choice(running)
            preempted[gone.request_id] = preempted.get(gone.request_id, 0) + 1
            _preempt(driver, gone)
            stats["preemptions"] += 1
            seqs = list(driver.active.values())
        taken = [s for s in seqs if rng.random() < share] or [rng.choice(seqs)]
        chunk = {s.slot: rng.choice(sizes) for s in taken}
        plan_rows = sum(min(chunk[s.slot], len(s.tokens) - s.computed) for s in taken)
        stats["widest_step"] = max(stats["widest_step"], plan_rows)
        kinds = {len(s.tokens) - s.computed == 1 for s in taken}
        stats["mixed_steps"] += len(kinds) == 2
        driver.step(chunk=lambda s, sizes=chunk: sizes[s.slot], only=set(chunk))
    return stats


def _preempt(driver: PlanDriver, seq: Seq) -> None:
    """``seq`` leaves the ranks (its slot released) and comes back as a new sequence
    holding every token it has, to be recomputed, as the scheduler preempts."""
    del driver.active[seq.slot]
    driver._released.append(seq.slot)
    again = driver.add(seq.request_id, seq.tokens, seq.params)
    again.num_prompt = seq.num_prompt
    driver._new[-1].num_prompt_tokens = seq.num_prompt  # max_tokens counts from the prompt


def differing(expected, got) -> list[tuple[str, int]]:
    """(label, position) of every recorded row of ``got`` whose logits are not the
    same bits as ``expected``'s."""
    found = []
    for label, rows in got.items():
        for position, each in rows.items():
            want = expected[label][position][0]
            found += [(label, position) for logits in each if not torch.equal(logits, want)]
    return found


def tp_rank(rank: int, world: int, port: int, dtype: str, count: int, out_file: str) -> None:
    """One rank of a batch-invariant engine of ``world`` ranks (gloo, under
    mp.spawn): the demo model's requests alone, then in a crowd; writes how many
    rows differed and each request's tokens."""
    import json

    import torch.distributed as dist

    from iterserve.models import DEMO_MODEL_PATH
    from iterserve.workers import ModelRunner

    def all_reduce(tensor):
        dist.all_reduce(tensor)
        return tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        runner = ModelRunner(DEMO_MODEL_PATH, dtype=dtype, num_kv_blocks=1024, block_size=16,
                             kernel_backend="cpu", tp_rank=rank, tp_size=world,
                             all_reduce=all_reduce, batch_invariant=True)  # fmt: skip
        prompts = dict(list(prompt_pool(runner.vocab_size).items())[:count])
        expected, tokens = alone(runner, prompts)
        steps = [(1.0, [1, 3, 16, 1 << 30], 0.15), (0.7, [2, 17, 64], 0.15)]
        scenario = Scenario({label: i // 4 for i, label in enumerate(prompts)}, steps, seed=3)
        got, got_tokens, stats = run(runner, prompts, scenario)
        with open(f"{out_file}.{rank}", "w") as f:
            json.dump({"differing": len(differing(expected, got)), "tokens": tokens,
                       "crowd_tokens": got_tokens, "preemptions": stats["preemptions"]}, f)  # fmt: skip
    finally:
        dist.destroy_process_group()
