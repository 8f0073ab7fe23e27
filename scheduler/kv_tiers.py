"""The KV cache's lower tiers as the scheduler keeps them: host memory and disk.

The block manager keeps the truth for every tier; the ranks only move bytes
where a plan tells them (:class:`~.messages.KVTransfers`) and report what
their disk did (:class:`~.messages.KVReport`). Pure Python, no I/O. A block's
key in every tier is its chained content hash (:mod:`.block_hash`); the disk's
files live in a directory per *fingerprint* of everything else that changes KV
(weights, dtype, kernels, block size, tensor-parallel layout), which the ranks
choose, so a key never meets another engine's KV::

    device arena   BlockManager.cached: hash -> block    (the prefix cache)
        | a block whose last reference goes (finish, abort, preemption) is
        v copied to a host slot at the start of the next step (write-through)
    host tier      host_slot: hash -> slot, least recently used evicted first
        | and written to its file in the background, unless the queue is full
        v
    disk tier      disk: hash, least recently used deleted first

A request that arrives with leading blocks on disk has them read into host
slots in the background (``prefetch``); it waits, while others run, until each
read is reported done or failed by every rank. Admission (``PrefixCache.hit``)
then finds its leading blocks on the device or in host memory and plans a
host -> device *load* into a fresh block for each one in host memory, a step
resource like new blocks, copied by the ranks before the step's rows; a block
whose read failed is computed again. Loading pays when copying a block costs
less than computing its tokens (``load_pays``, measured by the ranks at
start-up): otherwise the hit stops where the loads would begin.

Preemption is a swap with the same machinery: a preempted sequence's full
blocks are released like any others, so they are copied to host memory, and
loaded back when it resumes (its KV the same bytes it left with); only its
last, partial block is computed again.

With events on, each tier's changes are recorded as (kind, medium, key, ...)
tuples for the engine to publish (:mod:`iterserve.cluster.engine.kv_events`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .messages import KVReport, KVTransfers

if TYPE_CHECKING:
    from .request import Request

# The media a block lives in, with vLLM's event names for the first two.
DEVICE, HOST, DISK = "GPU", "CPU", "DISK"


@dataclass(frozen=True)
class TierConfig:
    """What the engine tells the scheduler about its tiers: their sizes in blocks,
    how many ranks report each disk read, what a load and a recompute cost (seconds
    per block copied host -> device, per token computed), whether to record events."""

    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    num_ranks: int = 1
    load_s_per_block: float = 0.0
    compute_s_per_token: float = math.inf
    events: bool = False


@dataclass(slots=True)
class _Read:
    slot: int
    key: bytes
    remaining: int  # ranks yet to report it
    failed: bool = False
    waiters: set[str] = field(default_factory=set)  # requests that wait for it


class KVTiers:
    """The host and disk tiers' index, their transfers for the next plan, and the
    events of every tier (the device's are told by the block manager)."""

    def __init__(self, config: TierConfig, block_size: int, device: dict[bytes, int]):
        self.config = config
        self.block_size = block_size
        self.device = device  # the block manager's hash -> block (read only)
        n = config.num_host_blocks
        self.host_slot: dict[bytes, int] = {}  # ready in host memory
        self.host_key: list[bytes | None] = [None] * n
        self._free_slots = list(range(n - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()  # ready, unpinned: oldest first
        self._pinned: set[int] = set()  # read by the plan being built: not reused in it
        self._reads: dict[int, _Read] = {}
        self._reading: dict[bytes, int] = {}  # key -> read id
        self._waiting: dict[str, set[int]] = {}  # request id -> read ids it waits for
        self._next_read = 0
        self.disk: OrderedDict[bytes, None] = OrderedDict()  # oldest use first
        # (parent key, token ids, adapter name) of keys some tier holds: for events
        # and for the disk's file headers.
        self.meta: dict[bytes, tuple[bytes | None, tuple[int, ...], str | None]] = {}
        self._out = KVTransfers()
        self.events: list[tuple] | None = [] if config.events else None
        self.counts = dict.fromkeys(
            ("host_queries", "host_hits", "disk_queries", "disk_hits", "stores", "loads",
             "writes", "writes_dropped", "reads", "reads_failed"), 0,
        )  # fmt: skip

    @property
    def host_enabled(self) -> bool:
        return self.config.num_host_blocks > 0

    @property
    def disk_enabled(self) -> bool:
        return self.config.num_disk_blocks > 0 and self.host_enabled

    @property
    def busy(self) -> bool:
        """Transfers to send, or disk reads whose reports have not all come."""
        return bool(self._reads) or self._has_transfers()

    def _has_transfers(self) -> bool:
        out = self._out
        return bool(out.store_blocks or out.load_slots or out.write_slots or out.read_ids
                    or out.delete_keys or out.clear_disk)  # fmt: skip

    # -- what the block manager tells -------------------------------------------------

    def registered(self, request: Request, hashes: list[bytes], indices: list[int]) -> None:
        """Blocks ``indices`` of ``request`` now hold their content on the device."""
        bs, tokens = self.block_size, request.all_token_ids
        for i in indices:
            key = hashes[i]
            if key not in self.meta:
                block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
                self.meta[key] = (hashes[i - 1] if i else None, block_tokens, request.lora_name)
            self._event("stored", DEVICE, key)

    def device_removed(self, key: bytes) -> None:
        """A device block's hash went (evicted, never computed, cleared)."""
        self._event("removed", DEVICE, key)
        self._forget_meta(key)

    def released(self, block: int, key: bytes) -> None:
        """A device block holding ``key`` has no reference left: it is copied down."""
        if not self.host_enabled or key in self._reading:
            return
        slot = self.host_slot.get(key)
        if slot is not None:
            if slot in self._lru:
                self._lru.move_to_end(slot)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._out.store_blocks.append(block)
        self._out.store_slots.append(slot)
        self.counts["stores"] += 1
        self._fill(slot, key)
        if self.disk_enabled and key not in self.disk:
            self._write(slot, key)

    # -- admission ----------------------------------------------------------------------

    def load_pays(self, num_blocks: int) -> bool:
        """Whether copying ``num_blocks`` from host memory beats computing their tokens."""
        cost = self.config
        return num_blocks * cost.load_s_per_block < (
            num_blocks * self.block_size * cost.compute_s_per_token
        )

    def load(self, slot: int, block: int) -> None:
        """Plans host ``slot`` -> device ``block`` (fresh) in the plan being built."""
        self._out.load_slots.append(slot)
        self._out.load_blocks.append(block)
        self._pin(slot)
        self.counts["loads"] += 1
        self._event("stored", DEVICE, self.host_key[slot])

    def prefetch(self, request: Request, hashes: list[bytes]) -> None:
        """Starts reading from disk the request's leading blocks found there (after
        those on the device or in host memory), as far as host slots allow; the
        request waits for them (:meth:`can_admit`)."""
        if not self.disk_enabled:
            return
        i = 0
        while i < len(hashes) and (hashes[i] in self.device or hashes[i] in self.host_slot):
            slot = self.host_slot.get(hashes[i])
            if slot is not None and slot in self._lru:
                self._lru.move_to_end(slot)  # the reads below must not evict it
            i += 1
        self.counts["disk_queries"] += (len(hashes) - i) * self.block_size
        for key in hashes[i:]:
            read_id = self._reading.get(key)
            if read_id is None:
                if key not in self.disk:
                    break
                slot = self._take_slot()
                if slot is None:
                    break
                read_id = self._read(slot, key)
            self._reads[read_id].waiters.add(request.request_id)
            self._waiting.setdefault(request.request_id, set()).add(read_id)
            self.counts["disk_hits"] += self.block_size

    def count_hit(self, request: Request, hit: list[int]) -> None:
        """Tokens an admitted request looked up below the device, and found there."""
        on_device = next((i for i, b in enumerate(hit) if b < 0), len(hit))
        max_blocks = (request.num_tokens - 1) // self.block_size
        self.counts["host_queries"] += (max_blocks - on_device) * self.block_size
        self.counts["host_hits"] += (len(hit) - on_device) * self.block_size

    def can_admit(self, request: Request) -> bool:
        """False while a disk read of its leading blocks is in flight."""
        return request.request_id not in self._waiting

    def forget(self, request_id: str) -> None:
        """A request ended: it waits for nothing (its reads still complete)."""
        for read_id in self._waiting.pop(request_id, ()):
            self._reads[read_id].waiters.discard(request_id)

    # -- the ranks' reports --------------------------------------------------------------

    def on_report(self, report: KVReport) -> None:
        for read_id in report.reads_done:
            self._reported(read_id, ok=True)
        for read_id in report.reads_failed:
            self._reported(read_id, ok=False)
        for hex_key in report.writes_dropped:
            key = bytes.fromhex(hex_key)
            self.counts["writes_dropped"] += 1
            if key in self.disk:
                self._drop_disk(key)

    def _reported(self, read_id: int, ok: bool) -> None:
        read = self._reads.get(read_id)
        if read is None:
            raise ValueError(f"a rank reported disk read {read_id}, which is not in flight")
        read.remaining -= 1
        read.failed |= not ok
        if read.remaining:
            return
        del self._reads[read_id]
        del self._reading[read.key]
        for request_id in read.waiters:
            waits = self._waiting[request_id]
            waits.discard(read_id)
            if not waits:
                del self._waiting[request_id]
        if read.failed:  # gone, corrupt or foreign on some rank: none keeps it
            self.counts["reads_failed"] += 1
            self._free_slots.append(read.slot)
            if read.key in self.disk:
                self._drop_disk(read.key)
            self._forget_meta(read.key)
        else:
            self._fill(read.slot, read.key)

    # -- the plan -------------------------------------------------------------------------

    def take_transfers(self) -> KVTransfers | None:
        """The transfers for the plan being built (None: none); its pins end."""
        for slot in self._pinned:
            if self.host_key[slot] is not None:
                self._lru[slot] = None
        self._pinned.clear()
        if not self._has_transfers():
            return None
        out, self._out = self._out, KVTransfers()
        return out

    # -- resets ---------------------------------------------------------------------------

    def ranks_lost(self) -> None:
        """The ranks died: their host memory with them, and every transfer and read
        not reported. The disk's index stays until the new ranks' scan replaces it."""
        for key in list(self.host_slot):
            self._event("removed", HOST, key)
        n = self.config.num_host_blocks
        self.host_slot.clear()
        self.host_key = [None] * n
        self._free_slots = list(range(n - 1, -1, -1))
        self._lru.clear()
        self._pinned.clear()
        self._reads.clear()
        self._reading.clear()
        self._waiting.clear()
        self._out = KVTransfers()
        self._prune_meta()

    def set_disk_index(
        self,
        entries: list[tuple[bytes, bytes | None, tuple[int, ...]]],
        orphans: Sequence[str] = (),
    ) -> None:
        """What the ranks found on disk, oldest use first: ``(key, parent, tokens)``
        each (the engine scanned them). Beyond the tier's size, the oldest go, as do
        ``orphans`` (hex keys only some ranks have a file of)."""
        if not self.disk_enabled:
            return
        self._out.delete_keys.extend(orphans)
        keep = entries[max(0, len(entries) - self.config.num_disk_blocks) :]
        for key, _, _ in entries[: len(entries) - len(keep)]:
            self._out.delete_keys.append(key.hex())
        fresh = {key for key, _, _ in keep}
        for key in [k for k in self.disk if k not in fresh]:
            self._drop_disk(key, delete=False)
        for key, parent, tokens in keep:
            if key in self.disk:
                continue
            self.meta.setdefault(key, (parent, tuple(tokens), None))
            self.disk[key] = None
            self._event("stored", DISK, key)

    def clear(self) -> None:
        """Empties the host and disk tiers (``reset_prefix_cache`` with
        ``reset_external``); reads in flight still complete into host memory."""
        for slot, key in enumerate(self.host_key):
            if key is not None and slot not in self._pinned:
                self._evict_slot(slot)
                self._free_slots.append(slot)
        self._lru.clear()
        if self.disk_enabled:
            for key in list(self.disk):
                self._drop_disk(key, delete=False)
            self._out.clear_disk = True
            self._out.write_slots.clear()
            self._out.write_keys.clear()
            self._out.write_parents.clear()
            self._out.write_tokens.clear()
            self._out.delete_keys.clear()

    # -- inside ------------------------------------------------------------------------------

    def _take_slot(self) -> int | None:
        """A host slot for new content: a free one, else the least recently used
        ready one nobody reads in the plan being built (its content goes)."""
        if self._free_slots:
            return self._free_slots.pop()
        if not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        self._evict_slot(slot)
        return slot

    def _evict_slot(self, slot: int) -> None:
        key = self.host_key[slot]
        assert key is not None
        self.host_key[slot] = None
        del self.host_slot[key]
        self._event("removed", HOST, key)
        self._forget_meta(key)

    def _fill(self, slot: int, key: bytes) -> None:
        self.host_key[slot] = key
        self.host_slot[key] = slot
        self._lru[slot] = None
        self._event("stored", HOST, key)

    def _pin(self, slot: int) -> None:
        self._lru.pop(slot, None)
        self._pinned.add(slot)

    def _write(self, slot: int, key: bytes) -> None:
        parent, tokens, adapter = self.meta.get(key, (None, (), None))
        if adapter is not None:
            return  # an adapter's registration is this engine's own: no file outlives it
        out = self._out
        out.write_slots.append(slot)
        out.write_keys.append(key.hex())
        out.write_parents.append("" if parent is None else parent.hex())
        out.write_tokens.append(list(tokens))
        self._pin(slot)  # a later store in this plan must not overwrite it first
        self.counts["writes"] += 1
        self.disk[key] = None
        self._event("stored", DISK, key)
        while len(self.disk) > self.config.num_disk_blocks:
            oldest = next(iter(self.disk))
            self._drop_disk(oldest)

    def _read(self, slot: int, key: bytes) -> int:
        read_id = self._next_read
        self._next_read += 1
        self._reads[read_id] = _Read(slot, key, self.config.num_ranks)
        self._reading[key] = read_id
        self.disk.move_to_end(key)
        out = self._out
        out.read_ids.append(read_id)
        out.read_slots.append(slot)
        out.read_keys.append(key.hex())
        self.counts["reads"] += 1
        return read_id

    def _drop_disk(self, key: bytes, delete: bool = True) -> None:
        del self.disk[key]
        if delete:
            self._out.delete_keys.append(key.hex())
        self._event("removed", DISK, key)
        self._forget_meta(key)

    def _forget_meta(self, key: bytes) -> None:
        if not (key in self.device or key in self.host_slot or key in self._reading
                or key in self.disk):  # fmt: skip
            self.meta.pop(key, None)

    def _prune_meta(self) -> None:
        for key in [k for k in self.meta if k not in self.device]:
            self._forget_meta(key)

    def _event(self, kind: str, medium: str, key: bytes | None) -> None:
        if self.events is None or key is None:
            return
        if kind == "stored":
            parent, tokens, adapter = self.meta.get(key, (None, (), None))
            self.events.append((kind, medium, key, parent, tokens, adapter))
        else:
            self.events.append((kind, medium, key))

    def take_events(self) -> list[tuple]:
        """The events recorded since the last call, oldest first."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    # -- introspection ---------------------------------------------------------------------

    def cached_set(self) -> set[tuple[str, bytes]]:
        """Every (medium, key) the tiers hold now, the device's included: what a
        subscriber to the events must have rebuilt."""
        held = {(DEVICE, key) for key in self.device}
        held |= {(HOST, key) for key in self.host_slot}
        held |= {(DISK, key) for key in self.disk}
        return held

    def stats(self) -> dict:
        return {
            "kv_host_blocks_total": self.config.num_host_blocks,
            "kv_host_blocks_cached": len(self.host_slot),
            "kv_disk_blocks_total": self.config.num_disk_blocks if self.disk_enabled else 0,
            "kv_disk_blocks_cached": len(self.disk),
            "kv_disk_reads_in_flight": len(self._reads),
            **{f"kv_{name}": value for name, value in self.counts.items()},
        }

    def check_integrity(self) -> None:
        """Free + ready + being read == every host slot; the indexes agree; the disk
        holds at most its size; whoever waits waits for a read in flight."""
        n = self.config.num_host_blocks
        ready = {s for s, k in enumerate(self.host_key) if k is not None}
        reading = {r.slot for r in self._reads.values()}
        free = set(self._free_slots)
        assert len(free) == len(self._free_slots), "a host slot is free twice"
        assert not (free & ready or free & reading or ready & reading), "a host slot is two things"
        assert len(free) + len(ready) + len(reading) == n, "host slots lost"
        assert {self.host_key[s]: s for s in ready} == self.host_slot, "host index disagrees"
        assert set(self._lru) | self._pinned == ready, "a ready host slot is neither LRU nor pinned"
        assert {r.key: i for i, r in self._reads.items()} == self._reading, "reads disagree"
        assert not set(self._reading) & set(self.host_slot), "a key both read and held"
        assert len(self.disk) <= self.config.num_disk_blocks, "the disk holds more than its size"
        for request_id, waits in self._waiting.items():
            assert waits, f"{request_id} waits for nothing"
            for read_id in waits:
                assert request_id in self._reads[read_id].waiters, "waiters disagree"
