"""The parts of the device check that need no GPU: the report written after
every figure, the budget, the tolerance rule, the residual-stream recorder,
the bytes a decode step reads, the caches the attention grid rotates over,
latency statistics and the chunked-prefill schedule."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from gpu_check_support import (  # noqa: E402
    TRUTH_FLOOR,
    TRUTH_RATIO,
    Budget,
    Report,
    StreamRecorder,
    against_truth,
    caches_to_rotate,
    decode_read_bytes,
    percentile,
    prefill_pieces,
    rel_err,
    summary,
)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_report_rewrites_the_file_after_every_figure(tmp_path):
    path = tmp_path / "out.json"
    clock = Clock()
    r = Report(False, path, started=clock.now, clock=clock)
    assert json.loads(path.read_text())["status"] == "running"
    r.begin("kernels")
    r.put("kernels", "a", 1.5)
    assert json.loads(path.read_text())["kernels"] == {"a": 1.5}
    clock.now += 2
    r.check("kernels", "b", False, {"err": 3})
    r.add_row("attention", "grid", {"batch": 1})
    r.skip("host", "budget: 0 s left")
    data = json.loads(path.read_text())
    assert data["failures"] == ["kernels.b"] and data["kernels"]["b"] == {"ok": False, "err": 3}
    assert data["attention"]["grid"] == [{"batch": 1}]
    assert data["skipped"] == {"host": "budget: 0 s left"}
    assert data["section"] == "kernels" and data["elapsed_s"] == 2.0
    r.finish()
    data = json.loads(path.read_text())
    assert data["status"] == "complete" and data["section"] is None
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary left


def test_report_without_a_path_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = Report(True)
    r.put("device", "x", 1)
    assert r.data["device"] == {"x": 1} and list(tmp_path.iterdir()) == []


def test_budget_counts_from_the_start():
    clock = Clock()
    b = Budget(10, clock.now, clock)
    assert b.allows(10) and not b.allows(10.5)
    clock.now += 7
    assert b.left() == pytest.approx(3) and b.allows(3) and not b.allows(4)
    clock.now += 5
    assert b.left() == pytest.approx(-2) and not b.allows(0)


def test_a_path_with_the_reference_error_passes_and_twice_it_fails():
    gen = torch.Generator().manual_seed(0)
    truth = torch.randn(4, 1000, generator=gen)
    noise = torch.randn(4, 1000, generator=gen)
    reference = truth + 0.01 * torch.randn(4, 1000, generator=gen)
    same = truth + 0.01 * noise
    twice = truth + 0.02 * noise
    ok = against_truth(same, reference, truth)
    assert ok["ok"] and 0.9 < ok["ratio_to_torch"] < 1.1 and ok["margin"] > 1.3
    assert ok["limit"] == pytest.approx(TRUTH_RATIO * ok["torch_rel_err_vs_fp32"] + TRUTH_FLOOR)
    bad = against_truth(twice, reference, truth)
    assert not bad["ok"] and bad["margin"] < 1
    nan = against_truth(same.clone().fill_(float("nan")), reference, truth)
    assert not nan["ok"]


def test_an_exact_reference_leaves_the_floor():
    truth = torch.ones(2, 8)
    assert against_truth(truth + 1e-6, truth, truth)["ok"]
    assert not against_truth(truth + 1e-2, truth, truth)["ok"]


def test_rel_err_is_the_norm_of_the_difference_over_the_norm():
    assert rel_err(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])) == 5.0
    assert rel_err(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 2.0])) == pytest.approx(1 / 5**0.5)


def test_stream_recorder_keeps_the_sum_of_each_fused_norm():
    from iterserve.kernels import get_ops

    rec = StreamRecorder(get_ops("torch"))
    w = torch.ones(4)
    x, res = torch.randn(3, 4), torch.randn(3, 4)
    rec.ops.rms_norm(x, w, 1e-5)  # no residual: nothing to keep
    for _ in range(4):
        out, summed = rec.ops.rms_norm(x, w, 1e-5, res)
    assert len(rec.streams) == 4 and torch.equal(rec.streams[0], x + res)
    assert len(rec.layers()) == 2  # after attention, after MLP: one layer each pair


def test_decode_bytes_count_used_embedding_rows_and_each_rows_kv():
    config = SimpleNamespace(vocab_size=1000, hidden_size=8, num_layers=2, num_kv_heads=2,
                             head_dim=4, tie_word_embeddings=False)  # fmt: skip
    table = 1000 * 8 * 2  # bf16 embedding table
    weights = 10 * table  # everything, the table included once
    got = decode_read_bytes(config, 2, weights, [5, 17, 1])
    # three embedding rows instead of the table; KV: (5 + 17 + 1) positions x
    # 2 layers x K and V x 2 heads x 4 dims x 2 bytes
    assert got["weights"] == weights - table + 3 * 8 * 2
    assert got["kv"] == 23 * 2 * 2 * 2 * 4 * 2
    assert got["total"] == got["weights"] + got["kv"]
    tied = decode_read_bytes(SimpleNamespace(**{**vars(config), "tie_word_embeddings": True}),
                             2, weights, [5])  # fmt: skip
    assert tied["weights"] == weights  # the LM head reads the whole table anyway


def test_enough_caches_rotate_to_outgrow_l2():
    l2 = 60 << 20
    assert caches_to_rotate(4 << 20, l2) == 60  # 4 x 60 MB / 4 MB
    assert caches_to_rotate(1 << 30, l2) == 1
    assert caches_to_rotate(1 << 10, l2) == 64  # capped
    assert caches_to_rotate(4 << 20, 0) == 1


def test_percentiles_interpolate_like_numpy():
    xs = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 99) == pytest.approx(4 + 0.96 * 6)
    assert percentile([7.0], 99) == 7.0
    s = summary([0.001, 0.003], scale=1e3)
    assert s == {"n": 2, "mean": pytest.approx(2.0), "median": pytest.approx(2.0),
                 "p99": pytest.approx(2.98)}  # fmt: skip


def test_prefill_pieces_fill_the_step_after_the_decodes():
    left = {0: 0, 1: 5, 2: 10, 3: 10}
    assert prefill_pieces(left, 2, 20) == [(1, 5), (2, 10), (3, 3)]
    assert prefill_pieces(left, 20, 20) == []
    assert prefill_pieces({0: 1024, 1: 1024}, 0, 16384) == [(0, 1024), (1, 1024)]
