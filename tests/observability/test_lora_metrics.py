"""Per-adapter metrics: requests running and waiting by adapter, resident adapters,
loads and evictions; an unloaded adapter's series go."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from iterserve.cluster.metrics.engine import EngineMetrics
from iterserve.cluster.metrics.recorder import MetricsRecorder
from iterserve.scheduler import FakeExecutor, Request, SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.driver import one_step, prompt_for


def samples(metrics: EngineMetrics) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            if s.name.startswith("iterserve_lora"):
                out[s.name, s.labels.get("adapter")] = s.value
    return out


def test_requests_by_adapter_residency_loads_and_evictions():
    sched = Scheduler(SchedulerConfig(policy="chunked", max_num_seqs=8, max_num_batched_tokens=64,
                                      max_model_len=64, block_size=4, num_kv_blocks=64,
                                      max_loras=1))  # fmt: skip
    for name in ("a", "b"):
        sched.adapters.register(name, f"/adapters/{name}")
    for i, lora in enumerate(["a", "a", "b"]):
        sched.add_request(Request(f"r{i}", prompt_for(f"r{i}", 5), SamplingParams(max_tokens=3),
                                  arrival_time=float(i), lora_name=lora))  # fmt: skip
    metrics = EngineMetrics("m", 0, "chunked")
    recorder = MetricsRecorder(metrics)
    executor = FakeExecutor(block_size=4)
    one_step(sched, executor)
    recorder.state(sched)
    got = samples(metrics)
    assert got["iterserve_lora_requests_running", "a"] == 2
    assert got["iterserve_lora_requests_waiting", "b"] == 1  # one slot: b waits for a's
    assert got["iterserve_lora_requests_running", "b"] == 0
    assert got["iterserve_lora_adapters_resident", None] == 1
    assert got["iterserve_lora_loads_total", None] == 1
    while sched.has_work:
        one_step(sched, executor)
    recorder.state(sched)
    got = samples(metrics)
    assert got["iterserve_lora_loads_total", None] == 2
    assert got["iterserve_lora_evictions_total", None] == 1
    sched.adapters.unregister("a")
    recorder.state(sched)
    got = samples(metrics)
    assert ("iterserve_lora_requests_running", "a") not in got
    assert ("iterserve_lora_requests_running", "b") in got
