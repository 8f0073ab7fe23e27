"""The engine's side of the KV tiers: what the ranks found at start-up handed to
the scheduler, the events published after each step, the tiers' metrics.

The ranks measure and scan; the scheduler keeps the index
(:mod:`iterserve.scheduler.kv_tiers`); this module, in the engine's process,
joins them: the host tier's size (the smallest rank's), the disk tier's size in
blocks (``kv_disk_cache_size`` over a whole block, every rank's shard
together), what a load and a recompute cost (rank 0's measures), and the
disk's index: the blocks every rank has a file of, least recently used first
(a file only some ranks have is deleted). It does so again after the ranks
restart.
"""

from __future__ import annotations

import logging
from typing import Any

from ...scheduler.kv_tiers import TierConfig
from . import kv_events

logger = logging.getLogger(__name__)
GiB = 1 << 30


class EngineKVTiers:
    def __init__(self, config: Any, engine_index: int, metrics: Any):
        self.config = config
        self.engine_index = engine_index
        self.metrics = metrics
        self.publisher: kv_events.KVEventPublisher | None = None
        self.block_bytes = 0
        self._counts: dict[str, int] = {}

    def tier_config(self, ranks: list[dict | None]) -> TierConfig | None:
        """The scheduler's :class:`TierConfig` from every rank's ``kv_tier_info``."""
        events = kv_events.enabled(self.config.kv_events_config)
        infos = [info for info in ranks if info]
        if not infos and not events:
            return None
        if infos and len(infos) != len(ranks):
            raise RuntimeError("some ranks have KV tiers and others not")
        if not infos:
            return TierConfig(num_ranks=len(ranks), events=True)
        self.block_bytes = sum(info["block_bytes"] for info in infos)
        disk = 0
        if self.config.kv_disk_cache_dir:
            disk = int(self.config.kv_disk_cache_size * GiB) // self.block_bytes
        return TierConfig(
            num_host_blocks=min(info["num_host_blocks"] for info in infos),
            num_disk_blocks=disk,
            num_ranks=len(ranks),
            load_s_per_block=max(info["load_s_per_block"] for info in infos),
            compute_s_per_token=infos[0]["compute_s_per_token"],
            events=events,
        )

    def started(self, scheduler: Any, ranks: list[dict | None]) -> None:
        """Hands the scheduler the disk's index; opens the event sockets (once)."""
        self.ranks_ready(scheduler, ranks)
        tiers = scheduler.tiers
        self.metrics.set_cache_config(
            block_size=scheduler.config.block_size,
            num_gpu_blocks=scheduler.blocks.num_blocks,
            num_cpu_blocks=tiers.config.num_host_blocks if tiers is not None else 0,
            num_disk_blocks=tiers.config.num_disk_blocks if tiers and tiers.disk_enabled else 0,
            enable_prefix_caching=scheduler.prefix_caching,
            prefix_caching_hash_algo=kv_events.HASH_ALGO,
        )
        if kv_events.enabled(self.config.kv_events_config) and self.publisher is None:
            self.publisher = kv_events.KVEventPublisher(
                self.config.kv_events_config, self.engine_index, self.config.scheduler.block_size
            )
            logger.info("KV events on %s", self.publisher.endpoints)
        self.after_step(scheduler)

    def ranks_ready(self, scheduler: Any, ranks: list[dict | None]) -> None:
        """After a start or a restart: the disk's index, as every rank's scan has it."""
        tiers = scheduler.tiers
        if tiers is None or not tiers.disk_enabled:
            return
        scans = [info["disk"] for info in ranks if info]
        common = set.intersection(*({key for key, _, _ in scan} for scan in scans))
        entries = [
            (bytes.fromhex(key), bytes.fromhex(parent) if parent else None, tuple(tokens))
            for key, parent, tokens in scans[0]
            if key in common
        ]
        orphans = {key for scan in scans for key, _, _ in scan} - common
        tiers.set_disk_index(entries, orphans=sorted(orphans))

    def after_step(self, scheduler: Any) -> None:
        """Publishes the events of the step just taken; records the tiers' metrics."""
        tiers = scheduler.tiers
        if tiers is None:
            return
        events = tiers.take_events()
        if self.publisher is not None and events:
            self.publisher.publish(events)
        if tiers.host_enabled:
            counts = dict(tiers.counts)
            delta = {k: v - self._counts.get(k, 0) for k, v in counts.items()}
            self._counts = counts
            if any(delta.values()):
                self.metrics.on_kv_tiers(delta, self.block_bytes)

    def observe(self, report: Any) -> None:
        """A step's KV report: how long its copies and the disk's work took."""
        if report is not None:
            self.metrics.on_kv_latency(report.copy_s, report.read_s, report.write_s)

    def stats(self, scheduler: Any) -> dict:
        out: dict[str, Any] = {"kv_block_hash": kv_events.HASH_ALGO}
        if self.publisher is not None:
            out["kv_events"] = self.publisher.endpoints
        if self.block_bytes:
            out["kv_block_bytes"] = self.block_bytes
        return out

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
