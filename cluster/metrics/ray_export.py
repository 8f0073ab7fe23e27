"""The engine's metric families mirrored into Ray's own metrics export."""

from __future__ import annotations

import logging
import queue
import threading

logger = logging.getLogger(__name__)


class RayMirror:
    """The same families in ``ray.util.metrics`` (Ray prefixes ``ray_`` on export and
    appends ``_total`` to counters itself, so names match the registry's).

    Ray's metric calls are slow next to a step's bookkeeping, and the ITL
    histogram alone records one per generated token: on the scheduler's loop
    they would take most of the control plane's time. Records are queued instead
    and replayed into Ray by a daemon thread; past ``MAX_PENDING`` queued
    records, new ones are dropped (``dropped`` counts them), so a stalled
    exporter never grows the queue."""

    MAX_PENDING = 100_000

    def __init__(self, model_name: str, engine: str):
        from ray.util import metrics as ray_metrics  # only engines that ask pay for Ray

        self._metrics: dict[str, tuple[object, tuple[str, ...]]] = {}
        from .engine import BASE_LABELS, SPECS

        for spec in SPECS:
            keys = spec.label_names
            if spec.kind == "counter":
                metric = ray_metrics.Counter(spec.name, spec.help, keys)
            elif spec.kind == "gauge":
                metric = ray_metrics.Gauge(spec.name, spec.help, keys)
            else:
                metric = ray_metrics.Histogram(spec.name, spec.help, list(spec.buckets), keys)
            metric.set_default_tags({"model_name": model_name, "engine": engine})
            self._metrics[spec.name] = (metric, keys[len(BASE_LABELS) :])
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self.dropped = 0
        threading.Thread(target=self._export, name="iterserve-ray-metrics", daemon=True).start()

    def record(self, method: str, name: str, value: float, extra: tuple) -> None:
        """``method`` is ``set``, ``inc`` or ``observe``, as on the registry's children."""
        if self._pending.qsize() >= self.MAX_PENDING:
            self.dropped += 1
            return
        self._pending.put((method, name, float(value), extra))

    def flush(self, timeout_s: float = 10.0) -> None:
        """Waits until every record queued so far has reached Ray (tests, shutdown)."""
        done = threading.Event()
        self._pending.put(done)
        done.wait(timeout_s)

    def _export(self) -> None:
        while True:
            item = self._pending.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            method, name, value, extra = item
            metric, keys = self._metrics[name]
            tags = dict(zip(keys, extra)) if keys else None
            try:
                getattr(metric, method)(value, tags=tags)
            except Exception:  # an exporter hiccup must not end the thread
                logger.exception("recording %s in Ray's metrics failed", name)
