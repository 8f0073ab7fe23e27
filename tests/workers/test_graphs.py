"""Decode graphs: bucket choice, padding and the static-buffer path.

Off a GPU the runner's graphs replay by rerunning the captured step on the same
static buffers (``EagerReplay``), so everything but the capture itself runs
here; the capture is checked by the GPU test below and by scripts/gpu_check.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from plan_driver import PlanDriver
from test_runner_greedy import expected, prompts

from iterserve.scheduler.messages import ScheduledSeq
from iterserve.workers import ModelRunner
from iterserve.workers.batch import HostBatch
from iterserve.workers.graphs import bucket_for, padded_arrays, replayable

SIZES = (1, 2, 4, 8)


def host(num_rows, q_len=1, width=3):
    n = num_rows
    i32 = dict(dtype=torch.int32)
    return HostBatch(
        input_ids=torch.arange(10, 10 + n, **i32),
        positions=torch.full((n,), 5, **i32),
        slot_mapping=torch.arange(n, **i32),
        logits_indices=torch.arange(n, **i32),
        seq_lens=torch.full((n,), 6, **i32),
        query_start_loc=torch.arange(n + 1, **i32),
        block_tables=torch.ones((n, width), **i32),
        sample_entries=[ScheduledSeq(i, 5, 1, sample=True) for i in range(n)],
        max_query_len=q_len,
        max_seq_len=6,
    )


def test_bucket_is_the_smallest_that_holds_the_rows():
    assert [bucket_for(n, SIZES) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_only_decode_steps_that_fit_replay():
    assert replayable(host(3), SIZES, width=4)
    assert not replayable(host(3, q_len=2), SIZES, width=4)  # a prefill piece: eager
    assert not replayable(host(9), SIZES, width=4)  # more rows than the largest bucket
    assert not replayable(host(3, width=5), SIZES, width=4)  # a longer sequence


def test_padding_rows_are_one_position_sequences_in_the_scratch_block():
    ids, positions, slots, rows, seq_lens, starts, tables = padded_arrays(
        host(3), bucket=4, width=5, scratch_block=7, block_size=16, pad_token_id=0
    )
    assert ids.tolist() == [10, 11, 12, 0]
    assert positions.tolist() == [5, 5, 5, 0]
    assert slots.tolist() == [0, 1, 2, 7 * 16]
    assert rows.tolist() == [0, 1, 2, 3]
    assert seq_lens.tolist() == [6, 6, 6, 1]
    assert starts.tolist() == [0, 1, 2, 3, 4]
    assert tables.tolist() == [[1, 1, 1, 7, 7]] * 3 + [[7] * 5]


def run_greedy(runner, ps, **kwargs):
    driver = PlanDriver(runner)
    for i, p in enumerate(ps):
        driver.add(f"r{i}", p)
    return driver.run(**kwargs)


def test_replayed_decodes_match_transformers(checkpoint_dir, hf_reference):
    ps = prompts(6)
    runner = ModelRunner(
        checkpoint_dir("llama"), num_kv_blocks=256, block_size=8, kernel_backend="torch",
        cuda_graphs=True, graph_batch_sizes=SIZES,
    )  # fmt: skip
    assert sorted(runner.graphs.graphs) == list(SIZES)
    assert run_greedy(runner, ps, chunk=16) == expected(hf_reference("llama"), ps)
    # Prefill steps ran eagerly, every decode step (6 rows, bucket 8) replayed.
    assert runner.graphs.num_replays >= 20


def test_rows_that_sample_out_of_order_get_their_own_logits(checkpoint_dir, hf_reference):
    """A decode row that does not sample (recomputing one token of a preempted
    sequence) sits before rows that do: their logits are picked by index."""
    ps = prompts(3)
    runner = ModelRunner(
        checkpoint_dir("llama"), num_kv_blocks=256, block_size=8, kernel_backend="torch",
        cuda_graphs=True, graph_batch_sizes=SIZES,
    )  # fmt: skip
    driver = PlanDriver(runner)
    for i, p in enumerate(ps):
        driver.add(f"r{i}", p)
    # r0 is computed one token per step; the others prefill whole, then decode.
    out = driver.run(chunk=lambda seq: 1 if seq.request_id == "r0" else 1 << 20)
    assert out == expected(hf_reference("llama"), ps)
    assert runner.graphs.num_replays > 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_replayed_decodes_on_the_triton_kernels(checkpoint_dir, hf_reference):
    """The graphs' fixed-width block tables and split plan, through the Triton
    kernels (interpreted on the CPU)."""
    ps = prompts(3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = ModelRunner(
        checkpoint_dir("llama"), num_kv_blocks=64, block_size=8, kernel_backend="triton",
        device=device, cuda_graphs=True, graph_batch_sizes=(1, 4), max_model_len=256,
    )  # fmt: skip
    assert run_greedy(runner, ps) == expected(hf_reference("llama"), ps)
    assert runner.graphs.num_replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_equals_eager(checkpoint_dir):
    ps = prompts(5)
    outs = []
    for graphs in (False, True):
        runner = ModelRunner(
            checkpoint_dir("llama"), num_kv_blocks=256, block_size=8, device="cuda",
            kernel_backend="triton", cuda_graphs=graphs, graph_batch_sizes=SIZES,
        )  # fmt: skip
        outs.append(run_greedy(runner, ps))
    assert outs[0] == outs[1]


def test_buckets_reach_exactly_the_schedulers_largest_batch():
    from iterserve.workers.graphs import graph_buckets

    assert graph_buckets(64)[-1] == 64 and graph_buckets(64)[:3] == (1, 2, 4)
    assert graph_buckets(100)[-2:] == (96, 100)
    assert graph_buckets(1) == (1,)
