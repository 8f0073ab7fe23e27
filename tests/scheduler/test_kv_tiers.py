"""The KV tiers below the device, as the block manager keeps them: blocks copied to
host memory and disk as they leave the device, found there again, loaded back,
read from disk in the background, lost files recomputed, the index rebuilt on a
restart. The fake executor models every tier's content (``check_kv``): a block
loaded with the wrong KV fails the step that reads it."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.scheduler import FakeExecutor, Request, SamplingParams, Scheduler, SchedulerConfig
from iterserve.scheduler.block_hash import prompt_block_hashes
from iterserve.scheduler.fake_executor import CORRUPT
from iterserve.scheduler.kv_tiers import DEVICE, DISK, HOST, TierConfig
from tests.scheduler.driver import Arrival, one_step, prompt_for, run

BS = 4


def make(num_kv_blocks=16, host=32, disk=0, events=False, ahead=False, **kw) -> Scheduler:
    config = dict(
        policy="chunked",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=40,
        block_size=BS,
        num_kv_blocks=num_kv_blocks,
    )
    config.update(kw)
    tiers = TierConfig(num_host_blocks=host, num_disk_blocks=disk, events=events,
                       load_s_per_block=1e-6, compute_s_per_token=1e-4)  # fmt: skip
    return Scheduler(SchedulerConfig(**config), ahead=ahead, tiers=tiers)


def fake(host=32, disk=None, **kw) -> FakeExecutor:
    return FakeExecutor(output_len=None, block_size=BS, check_kv=True, num_host_blocks=host,
                        kv_disk=disk, **kw)  # fmt: skip


def req(request_id: str, prompt: list[int], max_tokens: int = 3) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens))


def drain(sched: Scheduler, executor: FakeExecutor) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while sched.has_work:
        _, outs = one_step(sched, executor)
        sched.check_integrity()
        for out in outs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outputs


def test_a_prefix_evicted_from_the_device_is_loaded_back_from_host_memory():
    sched, executor = make(num_kv_blocks=12), fake()
    prompts = {f"p{i}": prompt_for(f"prefix{i}", 17) for i in range(4)}  # 4 full blocks each
    for name, prompt in prompts.items():  # each evicts the one before it from the device
        sched.add_request(req(name, prompt))
        drain(sched, executor)
    assert sched.tiers is not None and sched.tiers.counts["stores"] >= 12
    again = req("again", prompts["p0"])
    sched.add_request(again)
    plans = []
    while sched.has_work:
        scheduled = sched.schedule(0.0)
        plans.append(scheduled.plan)
        sched.update(executor.execute(scheduled.plan))
        sched.check_integrity()
    assert again.num_cached_tokens == 16  # its last token is always computed
    loads = [plan.kv.load_blocks for plan in plans if plan.kv and plan.kv.load_blocks]
    assert loads and len(loads[0]) >= 1
    assert sched.tiers.counts["host_hits"] > 0


def test_disk_blocks_are_read_in_the_background_before_the_request_is_admitted():
    disk: dict = {}
    sched, executor = make(disk=64), fake(disk=disk, read_delay=3)
    prompt = prompt_for("long", 21)
    sched.add_request(req("first", prompt))
    first = drain(sched, executor)
    assert len(disk) >= 5
    # A restart: a new scheduler and rank, the same disk; the engine hands over the scan.
    sched2, executor2 = make(disk=64), fake(disk=disk, read_delay=3)
    assert sched2.tiers is not None
    sched2.tiers.set_disk_index(_scan(executor2))
    request = req("first", prompt)
    sched2.add_request(request)
    first_plan = sched2.schedule(0.0).plan
    assert first_plan.kv is not None and len(first_plan.kv.read_ids) == 5
    assert not first_plan.scheduled  # it waits for its reads; nothing else to do
    assert drain_from(sched2, executor2, first_plan) == first
    assert request.num_cached_tokens == 20


def drain_from(sched, executor, plan) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for out in sched.update(executor.execute(plan)).outputs:
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    for request_id, tokens in drain(sched, executor).items():
        outputs.setdefault(request_id, []).extend(tokens)
    return outputs


def _scan(executor: FakeExecutor) -> list:
    return [(bytes.fromhex(k), bytes.fromhex(p) if p else None, tuple(t))
            for k, (_, p, t) in executor.kv_disk.items()]  # fmt: skip


def test_a_corrupt_or_missing_file_is_a_miss_recomputed_and_deleted():
    disk: dict = {}
    sched, executor = make(disk=64), fake(disk=disk)
    prompt = prompt_for("doc", 21)
    sched.add_request(req("a", prompt))
    expected = drain(sched, executor)["a"]
    keys = [h.hex() for h in prompt_block_hashes(prompt, BS)]
    disk[keys[1]] = (CORRUPT, *disk[keys[1]][1:])  # block 1: a bad checksum
    del disk[keys[3]]  # block 3: the file is gone
    sched2, executor2 = make(disk=64), fake(disk=disk)
    sched2.tiers.set_disk_index(_scan(executor2))
    request = req("a", prompt)
    sched2.add_request(request)
    assert drain(sched2, executor2)["a"] == expected
    assert request.num_cached_tokens == BS  # block 0 only: the run stops at the bad one
    assert sched2.tiers.counts["reads_failed"] == 1
    assert disk[keys[1]][0] != CORRUPT  # deleted, and written again once recomputed


def test_a_preempted_sequence_is_swapped_back_not_recomputed():
    # Eight blocks: two sequences of 8 prompt + 16 output tokens cannot both finish.
    sched, executor = make(num_kv_blocks=8, max_model_len=32), fake()
    for name in ("a", "b"):
        sched.add_request(req(name, prompt_for(name, 8), max_tokens=16))
    outputs = drain(sched, executor)
    assert sched.num_preemptions > 0
    for name in ("a", "b"):
        assert outputs[name] == [executor.token_at(name, i) for i in range(16)]
    # Only each resumption's partial last block is computed again.
    assert sched.num_recomputed_tokens <= sched.num_preemptions * BS


def test_recompute_wins_where_loading_costs_more():
    sched, executor = make(num_kv_blocks=12), fake()
    sched.tiers.config = TierConfig(
        num_host_blocks=32, load_s_per_block=1.0, compute_s_per_token=1e-4
    )
    prompts = [prompt_for(f"x{i}", 17) for i in range(4)]
    for i, prompt in enumerate(prompts):
        sched.add_request(req(f"x{i}", prompt))
        drain(sched, executor)
    again = req("again", prompts[0])
    sched.add_request(again)
    drain(sched, executor)
    assert again.num_cached_tokens == 0


def test_events_rebuild_the_set_of_blocks_every_tier_holds():
    disk: dict = {}
    sched, executor = make(num_kv_blocks=12, host=8, disk=16, events=True), fake(host=8, disk=disk)
    held: set[tuple[str, bytes]] = set()
    for i in range(6):
        sched.add_request(req(f"r{i}", prompt_for(f"e{i % 4}", 13)))
        drain(sched, executor)
        _apply(held, sched.tiers.take_events())
        assert held == sched.tiers.cached_set()
    assert {m for m, _ in held} == {DEVICE, HOST, DISK}
    sched.reset_prefix_cache(external=True)
    _apply(held, sched.tiers.take_events())
    assert held == sched.tiers.cached_set() == set()


def _apply(held: set, events: list[tuple]) -> None:
    for event in events:
        if event[0] == "stored":
            held.add((event[1], event[2]))
        else:
            held.discard((event[1], event[2]))


@st.composite
def workloads(draw):
    num_prefixes = draw(st.integers(1, 4))
    arrivals = []
    for i in range(draw(st.integers(1, 14))):
        arrivals.append(Arrival(
            request_id=f"r{i}",
            step=draw(st.integers(0, 30)),
            prompt_len=draw(st.integers(1, 24)),
            max_tokens=draw(st.integers(1, 12)),
            output_len=None,
            prefix=f"p{draw(st.integers(0, num_prefixes - 1))}",
            prefix_len=draw(st.integers(0, 20)),
            abort_step=draw(st.none() | st.integers(0, 40)),
        ))  # fmt: skip
    return arrivals


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=workloads(),
    second=workloads(),
    num_kv_blocks=st.integers(10, 24),
    host=st.integers(0, 24),
    disk=st.integers(0, 40),
    read_delay=st.integers(0, 3),
    ahead=st.booleans(),
    damage=st.lists(st.tuples(st.integers(0, 200), st.booleans()), max_size=6),
)
def test_every_tier_keeps_its_integrity_and_every_token_is_right(
    first, second, num_kv_blocks, host, disk, read_delay, ahead, damage
):
    """Two engine lives on one disk, with aborts, preemptions, evictions down every
    tier and files lost or corrupted in between: every step's checks hold (the
    block manager's and every tier's integrity, each position's KV), and every
    request gets exactly its own tokens."""
    files: dict = {}
    for workload in (first, second):
        sched = make(num_kv_blocks=num_kv_blocks, host=host, disk=disk, events=True, ahead=ahead)
        executor = fake(host=host, disk=files, read_delay=read_delay)
        sched.tiers.set_disk_index(_scan(executor))
        held: set = set()
        _apply(held, sched.tiers.take_events())
        log = run(sched, executor, [_copy(a) for a in workload], ahead=ahead)
        for a in workload:
            if log.reasons.get(a.key) != "abort":
                assert log.outputs[a.key] == [executor.token_at(a.key, i)
                                              for i in range(a.max_tokens)]  # fmt: skip
        _apply(held, sched.tiers.take_events())
        assert held == sched.tiers.cached_set()
        keys = list(files)
        for index, corrupt in damage:  # between the two lives
            if keys:
                key = keys[index % len(keys)]
                if corrupt and key in files:
                    files[key] = (CORRUPT, *files[key][1:])
                else:
                    files.pop(key, None)


def _copy(a: Arrival) -> Arrival:
    return Arrival(**{**a.__dict__})
