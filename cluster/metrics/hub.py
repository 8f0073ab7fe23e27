"""One Prometheus exposition for all engine replicas.

Engines live in different processes (Serve replicas, Ray actors), so the ingress cannot
read their registries. Each engine pushes ``EngineMetrics.snapshot()`` — plain data — to
one named actor every few seconds; on ``GET /metrics`` the ingress renders whatever the
hub holds::

    engine 0 ──push(key, snapshot)──┐
    engine 1 ──push(key, snapshot)──┤  MetricsHub  ──collect()──▶  render() ──▶ /metrics
    engine N ──push(key, snapshot)──┘  (drops entries older than max_age_s)

``render`` rebuilds the families through a prometheus_client collector and
``generate_latest``, so the merged text is well-formed by construction: one HELP/TYPE
per family, every engine's samples under it, told apart by their ``engine`` label.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

HUB_NAME = "iterserve-metrics-hub"
# Named actors are looked up per namespace; a fixed one lets engines and the ingress,
# whatever namespace Serve or a driver gives them, find the same hub.
HUB_NAMESPACE = "iterserve"
MAX_AGE_S = 30.0
PUSH_INTERVAL_S = 5.0  # well under MAX_AGE_S: one lost push never drops an engine
# Text format 0.0.4 is what every Prometheus version parses.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class SnapshotCollector(Collector):
    """Families rebuilt from snapshots; the first snapshot defining a family wins its
    HELP and TYPE. Samples that could not be exposed validly (a type clash between
    versions, a foreign sample name, a bad label name, a duplicate series) are dropped."""

    def __init__(self, snapshots: Iterable[list]):
        self._snapshots = list(snapshots)

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        seen: set[tuple] = set()
        for snapshot in self._snapshots:
            for name, typ, documentation, samples in snapshot:
                family = families.get(name)
                if family is None:
                    if typ not in _SUFFIXES:
                        continue
                    family = families[name] = Metric(name, documentation, typ)
                elif family.type != typ:
                    logger.warning(
                        "metric %s is %s in one engine, %s in another", name, family.type, typ
                    )
                    continue
                allowed = {name + suffix for suffix in _SUFFIXES[typ]}
                for sample_name, labels, value in samples:
                    key = (sample_name, tuple(sorted(labels.items())))
                    if sample_name not in allowed or key in seen:
                        continue
                    if not all(_LABEL_NAME.match(label) for label in labels):
                        continue
                    seen.add(key)
                    family.add_sample(sample_name, dict(labels), float(value))
        yield from families.values()


def render(snapshots: list) -> bytes:
    """Several engines' ``snapshot()`` as one Prometheus text exposition."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshots))
    return generate_latest(registry)


def render_local(metrics_list: Iterable) -> bytes:
    """The exposition of engines that live in this process (``EngineMetrics`` objects)."""
    return render([metrics.snapshot() for metrics in metrics_list])


class SnapshotStore:
    """Latest snapshot per engine key; an engine silent for ``max_age_s`` (dead, scaled
    down) disappears instead of exporting its last values forever."""

    def __init__(self, max_age_s: float = MAX_AGE_S, clock: Callable[[], float] = time.monotonic):
        self.max_age_s = max_age_s
        self._clock = clock
        self._entries: dict[str, tuple[float, list]] = {}

    def push(self, engine_key: str, snapshot: list) -> None:
        self._entries[engine_key] = (self._clock(), snapshot)

    def remove(self, engine_key: str) -> None:
        self._entries.pop(engine_key, None)

    def collect(self) -> list:
        cutoff = self._clock() - self.max_age_s
        self._entries = {k: v for k, v in self._entries.items() if v[0] >= cutoff}
        return [snapshot for _, (_, snapshot) in sorted(self._entries.items())]


@ray.remote(num_cpus=0)
class MetricsHub:
    """The cluster's one ``SnapshotStore``, as a named actor."""

    def __init__(self, max_age_s: float = MAX_AGE_S):
        self._store = SnapshotStore(max_age_s)

    def push(self, engine_key: str, snapshot: list) -> None:
        self._store.push(engine_key, snapshot)

    def remove(self, engine_key: str) -> None:
        self._store.remove(engine_key)

    def collect(self) -> list:
        return self._store.collect()


def get_or_create_hub(
    name: str = HUB_NAME, *, namespace: str = HUB_NAMESPACE, max_age_s: float = MAX_AGE_S
):
    """The hub actor called ``name``, created on first use. Detached, so it outlives the
    engine that happened to create it; ``get_if_exists`` makes concurrent callers agree."""
    # DEFAULT scheduling: an engine replica's placement group captures the actors it
    # creates, and the hub must neither take a bundle nor die with that replica.
    return MetricsHub.options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy="DEFAULT",
    ).remote(max_age_s)


async def push_periodically(
    metrics, engine_key: str, *, hub_name: str = HUB_NAME, interval_s: float = PUSH_INTERVAL_S
) -> None:
    """Pushes ``metrics.snapshot()`` every ``interval_s`` until cancelled. A failed push
    (the hub restarting) is logged and retried next time with a freshly resolved hub."""
    hub = None
    while True:
        try:
            if hub is None:
                hub = get_or_create_hub(hub_name)
            await hub.push.remote(engine_key, metrics.snapshot())
        except Exception as exc:  # the engine must keep serving without its metrics
            logger.warning("metrics push to %s failed: %s", hub_name, exc)
            hub = None
        await asyncio.sleep(interval_s)
