"""The recorder turns the scheduler's prefix-cache counts into the engine's series."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from iterserve.cluster.metrics.engine import EngineMetrics
from iterserve.cluster.metrics.recorder import MetricsRecorder
from iterserve.scheduler import FakeExecutor, Request, SamplingParams, Scheduler, SchedulerConfig


def values(metrics: EngineMetrics) -> dict[str, float]:
    text = metrics.exposition().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_prefix_cache_hits_queries_and_cached_blocks_reach_the_metrics():
    sched = Scheduler(SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, block_size=4,
        num_kv_blocks=16,
    ))  # fmt: skip
    executor = FakeExecutor(output_len=None, block_size=4, check_kv=True)
    metrics = EngineMetrics("demo", 0, "chunked")
    recorder = MetricsRecorder(metrics)
    prompt = list(range(3, 13))  # two full blocks, then a partial one
    for i in range(3):
        request = Request(f"r{i}", prompt, SamplingParams(max_tokens=2))
        sched.add_request(request)
        recorder.admitted(request)
    while sched.has_work:
        step = sched.schedule(0.0)
        result = executor.execute(step.plan)
        recorder.outputs(sched.update(result).outputs)
        recorder.step(step, result, 0.01, sched)
    got = values(metrics)
    # All three were admitted in one step: the second and third found the first's blocks.
    assert got["iterserve_prefix_cache_queries_total"] == 30
    assert got["iterserve_prefix_cache_hits_total"] == 16
    assert got["iterserve_kv_blocks_cached"] == sched.blocks.num_cached > 0
    assert got["iterserve_prefix_cache_evictions_total"] == 0


class _Clock:
    """A monotonic clock that moves one second each time it is read."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now


def test_queue_time_is_recorded_for_requests_whose_label_is_not_their_id(monkeypatch):
    """The engine names a request by its own id; a client's label (what the ranks
    log) is another string. Requests that waited for a slot must show that wait as
    queue time, and the first token's time must split into queue and prefill."""
    from iterserve.cluster.metrics import recorder as recorder_module

    clock = _Clock()
    monkeypatch.setattr(recorder_module, "time", clock)
    sched = Scheduler(SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32, block_size=4,
        num_kv_blocks=32,
    ))  # fmt: skip
    executor = FakeExecutor(output_len=3, block_size=4)
    metrics = EngineMetrics("demo", 0, "chunked")
    recorder = MetricsRecorder(metrics)
    for i in range(6):  # two slots: four of them wait
        request = Request(f"ingress.{i}", [3 + i, 4, 5], SamplingParams(max_tokens=3),
                          arrival_time=clock.monotonic(), label=f"client-{i}")  # fmt: skip
        sched.add_request(request)
        recorder.admitted(request)
    while sched.has_work:
        step = sched.schedule(clock.monotonic())
        result = executor.execute(step.plan)
        outputs = sched.update(result).outputs
        recorder.step(step, result, 0.5, sched)  # as the engine does: the step, then its outputs
        recorder.outputs(outputs)
    got = values(metrics)
    assert got["iterserve_request_queue_time_seconds_count"] == 6
    assert got["iterserve_request_queue_time_seconds_sum"] > 0
    queue_and_prefill = (
        got["iterserve_request_queue_time_seconds_sum"]
        + got["iterserve_request_prefill_time_seconds_sum"]
    )
    assert queue_and_prefill == got["iterserve_time_to_first_token_seconds_sum"]
