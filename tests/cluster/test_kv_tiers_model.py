"""The KV tiers on the real model (fp32): a preempted sequence swapped back through
host memory gives the tokens it would have given unpreempted; prompts found on
disk after a restart give the tokens computed ones give; a corrupt or truncated
file is a miss, recomputed, and deleted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from iterserve.scheduler import Scheduler, SchedulerConfig
from iterserve.scheduler.kv_tiers import TierConfig
from iterserve.workers.kv_tiers import DiskShard, RankTiers, TieredExecutor, fingerprint
from tests.scheduler.driver import Arrival, prompt_for, run

BS = 4


def runner_with_tiers(path: str, num_blocks: int, num_host: int, disk_dir: Path | None = None):
    from iterserve.workers.runner import ModelRunner

    runner = ModelRunner(path, dtype="float32", num_kv_blocks=num_blocks, block_size=BS,
                         kernel_backend="torch")  # fmt: skip
    tiers = RankTiers(runner.kv_cache, num_host)
    if disk_dir is not None:
        fp = fingerprint(path, runtime=None, dtype="float32", kernel_backend="torch",
                         block_size=BS, tp_size=1)  # fmt: skip
        tiers.disk = DiskShard(disk_dir, fp, 0, tiers.block_bytes)
    return TieredExecutor(runner, tiers)


def scheduler_for(executor: TieredExecutor, num_blocks: int, disk_blocks: int = 0) -> Scheduler:
    info = executor.kv_tier_info()
    tiers = TierConfig(num_host_blocks=info["num_host_blocks"], num_disk_blocks=disk_blocks,
                       load_s_per_block=info["load_s_per_block"],
                       compute_s_per_token=info["compute_s_per_token"])  # fmt: skip
    sched = Scheduler(SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=BS,
        num_kv_blocks=num_blocks,
    ), tiers=tiers)  # fmt: skip
    if disk_blocks:
        sched.tiers.set_disk_index([
            (bytes.fromhex(k), bytes.fromhex(p) if p else None, tuple(t))
            for k, p, t in info["disk"]
        ])  # fmt: skip
    return sched


def reference(path: str, arrivals: list[Arrival]) -> dict[str, list[int]]:
    from iterserve.workers.runner import ModelRunner

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=64, block_size=BS, num_kv_blocks=200,
                                      enable_prefix_caching=False))  # fmt: skip
    runner = ModelRunner(path, dtype="float32", num_kv_blocks=200, block_size=BS,
                         kernel_backend="torch")  # fmt: skip
    return run(sched, runner, arrivals).outputs


def test_a_swapped_sequence_gives_the_tokens_it_would_have_unpreempted(tiny_llama):
    arrivals = [
        Arrival(f"s{i}", step=0, prompt_len=10 + i, max_tokens=40, output_len=None)
        for i in range(4)
    ]
    expected = reference(tiny_llama, [Arrival(**a.__dict__) for a in arrivals])
    executor = runner_with_tiers(tiny_llama, num_blocks=24, num_host=96)
    sched = scheduler_for(executor, num_blocks=24)
    log = run(sched, executor, arrivals, ahead=True)
    assert sched.num_preemptions > 0
    assert log.outputs == expected
    # A resumed sequence computes its last, partial block again and nothing else.
    assert sched.num_recomputed_tokens <= sched.num_preemptions * BS
    assert sched.tiers.counts["loads"] > 0


def test_prompts_found_on_disk_after_a_restart_give_the_same_tokens(tiny_llama, tmp_path):
    prompts = [prompt_for(f"doc{i}", 30) for i in range(3)]
    arrivals = [Arrival(f"d{i}", step=i, prompt_len=30, max_tokens=8, output_len=None,
                        prompt=prompts[i]) for i in range(3)]  # fmt: skip
    expected = reference(tiny_llama, [Arrival(**a.__dict__) for a in arrivals])
    first = runner_with_tiers(tiny_llama, num_blocks=40, num_host=64, disk_dir=tmp_path)
    log = run(scheduler_for(first, 40, disk_blocks=200), first, arrivals)
    assert log.outputs == expected
    _settle(first)
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) >= 3 * 7
    # A truncated file and a corrupt one: misses, deleted, their tokens computed again.
    files[0].write_bytes(files[0].read_bytes()[:100])
    data = bytearray(files[1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[1].write_bytes(bytes(data))
    second = runner_with_tiers(tiny_llama, num_blocks=40, num_host=64, disk_dir=tmp_path)
    sched = scheduler_for(second, 40, disk_blocks=200)
    again = [Arrival(**a.__dict__) for a in arrivals]
    log = run(sched, second, again)
    assert log.outputs == expected
    assert sched.tiers.counts["disk_hits"] > 0
    assert sched.tiers.counts["reads_failed"] >= 1
    assert sched.tiers.counts["host_hits"] >= 2 * 7 * BS  # most of the prompts came back


def _settle(executor: TieredExecutor) -> None:
    """Waits until the disk's writer has written everything queued."""
    import time

    disk = executor.tiers.disk
    deadline = time.monotonic() + 30
    while (disk.ops.qsize() or disk._num_writes) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)


@pytest.mark.usefixtures("ray_session")
async def test_two_ranks_keep_their_shards_and_find_them_again_after_a_restart(
    tiny_llama, tmp_path
):
    """Tensor parallelism: each rank writes and reads its own shard of a block; a
    read counts once every rank has reported it. A second engine on the same
    directory serves the prompts from disk, as one process computes them."""
    from iterserve.scheduler import SamplingParams
    from tests.cluster.conftest import collect_all, model_config, start_engine, wait_idle
    from tests.cluster.test_prefix_cache import single_process_outputs

    prompts = [prompt_for(f"tp{i}", 30) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = single_process_outputs(tiny_llama, prompts, params, enable_prefix_caching=False)
    config = model_config(tiny_llama, tensor_parallel_size=2, kv_offloading_size=0.001,
                          kv_disk_cache_dir=str(tmp_path), kv_disk_cache_size=0.01)  # fmt: skip
    for life in range(2):
        engine = await start_engine(config)
        try:
            results = await collect_all(engine, prompts, params)
            assert [tokens for tokens, _ in results] == expected
            stats = await wait_idle(engine)
            if life == 0:
                await asyncio.sleep(1.0)  # the writers' files land
                assert len(list(tmp_path.glob("*/rank1/*/*.kv"))) >= 3 * 7
            else:
                assert stats["kv_disk_hits"] > 0 and stats["kv_reads_failed"] == 0
        finally:
            await engine.shutdown()
