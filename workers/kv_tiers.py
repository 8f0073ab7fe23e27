"""A rank's KV tiers below the device: a host arena and its shard of the disk tier.

The scheduler decides every move (:mod:`iterserve.scheduler.kv_tiers`); a rank
applies a plan's :class:`~iterserve.scheduler.messages.KVTransfers` at the
start of the step, before its rows, and reports its disk's background work in
the step's :class:`~iterserve.scheduler.messages.KVReport`:

- stores (device block -> host slot) and loads (host slot -> device block) are
  copies between the paged cache and the host arena (on CPU a second arena; on
  CUDA pinned host memory, copied on a side stream the forward waits for);
- disk writes and deletions go to a writer thread through a bounded queue: a
  write that finds it full is dropped (and reported), never waited for; the
  writer runs at the lowest CPU priority, so that steps keep the cores;
- disk reads go to a reader thread and complete into their host slot; each is
  reported once, done or failed.

Files are content-addressed: ``DIR/<fingerprint>/rank<r>/<key[:2]>/<key>.kv``,
where the fingerprint hashes everything that changes a block's KV other than
its tokens (the weight files' bytes, the config, dtype and the engine's other
numerics choices, kernel backend, block size, tensor-parallel layout), so a
directory is one engine kind's and a key never meets another's KV. A file is a
header (magic, fingerprint, key, parent, tokens, payload size), the payload and
a CRC-32 of both; a file that is truncated, fails its checksum or names another
fingerprint or key is a miss, deleted. Writes land in a temporary file renamed
into place, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..scheduler.messages import KVReport, KVTransfers, StepPlan, StepResult

logger = logging.getLogger(__name__)

MAGIC = b"ISKV\x00\x01\x00\x00"
FORMAT = 1
# Writes waiting for the disk, at most: past it they are dropped. A queued write only
# names its host slot (copied out when the writer reaches it), and a store into that
# slot would wait for it: a quarter of the host tier keeps that rare.
MAX_WRITE_QUEUE = 4096
IDLE_WAIT_S = 0.02  # what a step without rows waits for a disk read to finish
_HEADER_LEN = struct.Struct("<I")


def fingerprint(model_path: str | Path, *, runtime: dict | None, dtype: str,
                kernel_backend: str, block_size: int, tp_size: int) -> str:  # fmt: skip
    """The namespace of a block's KV: what changes it other than its tokens."""
    h = hashlib.sha256(f"iterserve-kv-files-{FORMAT}".encode())
    for path in sorted(Path(model_path).iterdir()):
        if path.suffix == ".safetensors" or path.name == "config.json":
            h.update(path.name.encode())
            h.update(_file_digest(path))
    choices = {k: v for k, v in (runtime or {}).items() if k != "dtype_reason"}
    h.update(json.dumps({"runtime": choices, "dtype": dtype, "kernel_backend": kernel_backend,
                         "block_size": block_size, "tp_size": tp_size},
                        sort_keys=True).encode())  # fmt: skip
    return h.hexdigest()[:32]


def _file_digest(path: Path) -> bytes:
    """SHA-256 of a weight file, kept beside it keyed by its size and mtime so that
    a restart does not read gigabytes again (a cache dir of its own when the
    checkpoint's is read-only)."""
    st = path.stat()
    stamp = f"{st.st_size}-{st.st_mtime_ns}"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "iterserve-digests"
    entry = cache / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24] + ".txt")
    try:
        saved_stamp, digest = entry.read_text().split()
        if saved_stamp == stamp:
            return bytes.fromhex(digest)
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        entry.write_text(f"{stamp} {h.hexdigest()}")
    except OSError:
        pass
    return h.digest()


class DiskShard:
    """One rank's files of the disk tier, with a writer and a reader thread."""

    def __init__(self, root: str | Path, fp: str, rank: int, payload_bytes: int,
                 max_queue: int = MAX_WRITE_QUEUE):  # fmt: skip
        self.fp = fp
        self.max_queue = max_queue
        self.dir = Path(root) / fp / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.payload_bytes = payload_bytes
        # Writes, deletions and clears in the order the plans gave them (one queue:
        # a deletion must not overtake the write it undoes); writes past
        # ``max_queue`` waiting are dropped, the others never.
        self.ops: queue.Queue = queue.Queue()
        self._num_writes = 0
        self.reads: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()  # (kind, id or key, ok, seconds)
        # Host slots a queued write has not copied out yet: a store into one waits.
        self._busy_slots: dict[int, int] = {}
        self._slots_free = threading.Condition()
        for target, name in ((self._write_loop, "kv-disk-writer"),
                             (self._read_loop, "kv-disk-reader")):  # fmt: skip
            threading.Thread(target=target, name=name, daemon=True).start()

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.kv"

    # -- the step's side ----------------------------------------------------------------

    def write(self, key: str, slot: int, parent: str, tokens: list[int], snapshot, ready) -> bool:
        """Queues a write of host ``slot`` (``snapshot(slot) -> bytes``, once ``ready()``
        says the step's stores are done); False when too many wait (dropped)."""
        with self._slots_free:
            if self._num_writes >= self.max_queue:
                return False
            self._num_writes += 1
            self._busy_slots[slot] = self._busy_slots.get(slot, 0) + 1
        self.ops.put(("write", key, slot, parent, tokens, snapshot, ready))
        return True

    def order(self, op: tuple) -> None:
        """A deletion (``("delete", key)``) or ``("clear",)``, after the writes queued
        before it."""
        self.ops.put(op)

    def wait_slots(self, slots: list[int]) -> None:
        """Returns once no queued write still has to copy one of ``slots``."""
        with self._slots_free:
            while any(s in self._busy_slots for s in slots):
                self._slots_free.wait()

    def _release_slot(self, slot: int) -> None:
        with self._slots_free:
            n = self._busy_slots.pop(slot) - 1
            if n:
                self._busy_slots[slot] = n
            self._num_writes -= 1
            self._slots_free.notify_all()

    # -- the writer ------------------------------------------------------------------------

    def _write_loop(self) -> None:
        _lowest_priority()
        while True:
            op = self.ops.get()
            if op[0] == "delete":
                self.path(op[1]).unlink(missing_ok=True)
                continue
            if op[0] == "clear":
                for f in self.dir.glob("*/*"):
                    f.unlink(missing_ok=True)
                continue
            _, key, slot, parent, tokens, snapshot, ready = op
            start = time.perf_counter()
            try:
                ready()
                payload = snapshot(slot)
            finally:
                self._release_slot(slot)
            ok = self._write_file(key, parent, tokens, payload)
            self.done.put(("write", key, ok, time.perf_counter() - start))

    def _write_file(self, key: str, parent: str, tokens: list[int], payload: bytes) -> bool:
        header = json.dumps({"fingerprint": self.fp, "key": key, "parent": parent,
                             "tokens": tokens, "bytes": len(payload)}).encode()  # fmt: skip
        body = MAGIC + _HEADER_LEN.pack(len(header)) + header + payload
        path = self.path(key)
        tmp = path.with_suffix(f".tmp{threading.get_ident()}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(body)
                f.write(struct.pack("<I", zlib.crc32(body)))
            os.replace(tmp, path)
            return True
        except OSError as exc:
            logger.warning("writing KV block %s: %s", key, exc)
            tmp.unlink(missing_ok=True)
            return False

    # -- the reader -------------------------------------------------------------------------

    def read(self, read_id: int, key: str, slot: int, fill) -> None:
        """Queues a read of ``key`` into host ``slot`` (``fill(slot, payload)``)."""
        self.reads.put((read_id, key, slot, fill))

    def _read_loop(self) -> None:
        while True:
            read_id, key, slot, fill = self.reads.get()
            start = time.perf_counter()
            payload = self.read_file(key)
            ok = payload is not None
            if ok:
                try:
                    fill(slot, payload)
                except Exception:  # a payload of the right size always fits: a bug, not a miss
                    logger.exception("filling host slot %d", slot)
                    ok = False
            self.done.put(("read", read_id, ok, time.perf_counter() - start))

    def read_file(self, key: str) -> bytes | None:
        """The payload of ``key``'s file, or None (gone, truncated, corrupt, foreign:
        then deleted)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        header = self._parse(data)
        if header is None or header["key"] != key or header["bytes"] != self.payload_bytes:
            logger.warning("KV file %s is corrupt or foreign: deleted", path.name)
            path.unlink(missing_ok=True)
            return None
        return data[-4 - self.payload_bytes : -4]

    def _parse(self, data: bytes) -> dict | None:
        if len(data) < len(MAGIC) + 8 or not data.startswith(MAGIC):
            return None
        (crc,) = struct.unpack("<I", data[-4:])
        if zlib.crc32(data[:-4]) != crc:
            return None
        (n,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
        try:
            header = json.loads(data[len(MAGIC) + 4 : len(MAGIC) + 4 + n])
        except ValueError:
            return None
        if not isinstance(header, dict) or header.get("fingerprint") != self.fp:
            return None
        expected = len(MAGIC) + 4 + n + header.get("bytes", -1) + 4
        return header if len(data) == expected else None

    def scan(self) -> list[tuple[str, str, list[int]]]:
        """``(key, parent, tokens)`` of every file, least recently used first (by
        modification time); a file whose header does not parse is deleted, as are
        temporary files a stopped writer left."""
        found = []
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.suffix != ".kv":
                    f.unlink(missing_ok=True)
                    continue
                try:
                    with open(f, "rb") as fh:
                        head = fh.read(len(MAGIC) + 4)
                        (n,) = _HEADER_LEN.unpack_from(head, len(MAGIC))
                        header = json.loads(fh.read(n))
                    mtime = f.stat().st_mtime_ns
                    if not head.startswith(MAGIC) or header["key"] != f.stem:
                        raise ValueError("foreign")
                    found.append((mtime, f.stem, header["parent"], list(header["tokens"])))
                except (OSError, ValueError, KeyError, struct.error):
                    f.unlink(missing_ok=True)
        found.sort()
        return [(key, parent, tokens) for _, key, parent, tokens in found]


def _lowest_priority() -> None:
    """This thread at nice 19 (Linux sets niceness per thread): it takes a core
    only when the steps leave one."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass


@dataclass
class RankTiers:
    """A rank's host arena (``[num_host_blocks, block_size, kv_heads, head_dim]`` per
    layer, K and V, like the device cache) and disk shard (None: no disk tier)."""

    kv: Any  # the rank's KVCache
    num_host_blocks: int
    disk: DiskShard | None = None
    host_keys: list[torch.Tensor] = field(default_factory=list)
    host_values: list[torch.Tensor] = field(default_factory=list)
    _stream: Any = None
    _stored: Any = None  # the event the last stores recorded (CUDA)
    _pending_reads: int = 0
    _report: KVReport = field(default_factory=KVReport)

    def __post_init__(self) -> None:
        shape = (self.num_host_blocks, *self.kv.keys[0].shape[1:])
        cuda = self.kv.keys[0].device.type == "cuda"
        dtype = self.kv.keys[0].dtype

        def arena() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=cuda)

        self.host_keys = [arena() for _ in self.kv.keys]
        self.host_values = [arena() for _ in self.kv.values]
        if cuda:
            self._stream = torch.cuda.Stream()

    @property
    def block_bytes(self) -> int:
        t = self.host_keys[0]
        return 2 * len(self.host_keys) * t[0].numel() * t.element_size()

    # -- a step ---------------------------------------------------------------------------

    def begin(self, kv: KVTransfers | None) -> None:
        """A plan's transfers, before its rows (see the module docstring)."""
        if kv is None:
            return
        start = time.perf_counter()
        if kv.store_blocks:
            if self.disk is not None:
                self.disk.wait_slots(kv.store_slots)
            self._copy(kv.store_blocks, kv.store_slots, to_host=True)
        if kv.load_blocks:
            self._copy(kv.load_blocks, kv.load_slots, to_host=False)
        if self._stream is not None and (kv.store_blocks or kv.load_blocks):
            torch.cuda.current_stream().wait_stream(self._stream)  # the forward waits
            self._stored = torch.cuda.Event()
            self._stored.record(self._stream)
        self._report.copy_s += time.perf_counter() - start
        disk = self.disk
        if disk is None:
            return
        if kv.clear_disk:
            disk.order(("clear",))
        stored = self._stored
        ready = (lambda: stored.synchronize()) if stored is not None else (lambda: None)
        for slot, key, parent, tokens in zip(kv.write_slots, kv.write_keys, kv.write_parents,
                                             kv.write_tokens, strict=True):  # fmt: skip
            if not disk.write(key, slot, parent, tokens, self._snapshot, ready):
                self._report.writes_dropped.append(key)
        for key in kv.delete_keys:
            disk.order(("delete", key))
        for read_id, slot, key in zip(kv.read_ids, kv.read_slots, kv.read_keys, strict=True):
            disk.read(read_id, key, slot, self._fill)
            self._pending_reads += 1

    def _copy(self, blocks: list[int], slots: list[int], *, to_host: bool) -> None:
        device, host = self.kv.keys[0].device, self.host_keys[0].device
        b = torch.tensor(blocks, dtype=torch.long, device=device)
        s = torch.tensor(slots, dtype=torch.long, device=host)
        pairs = list(zip(self.kv.keys + self.kv.values, self.host_keys + self.host_values))
        if self._stream is None:  # one arena to another: index copies
            for dev, arena in pairs:
                if to_host:
                    arena.index_copy_(0, s, dev.index_select(0, b))
                else:
                    dev.index_copy_(0, b, arena.index_select(0, s))
            return
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for dev, arena in pairs:
                for block, slot in zip(blocks, slots):
                    if to_host:
                        arena[slot].copy_(dev[block], non_blocking=True)
                    else:
                        dev[block].copy_(arena[slot], non_blocking=True)

    def _snapshot(self, slot: int) -> bytes:
        parts = [t[slot] for pair in zip(self.host_keys, self.host_values) for t in pair]
        return torch.stack(parts).contiguous().view(torch.uint8).numpy().tobytes()

    def _fill(self, slot: int, payload: bytes) -> None:
        t = self.host_keys[0]
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(t.dtype)
        data = data.view(2 * len(self.host_keys), *t.shape[1:])
        for i, (k, v) in enumerate(zip(self.host_keys, self.host_values)):
            k[slot].copy_(data[2 * i])
            v[slot].copy_(data[2 * i + 1])

    def report(self, idle: bool = False) -> KVReport | None:
        """What the disk finished since the last report; a step without rows waits a
        little for a read in flight, so that polling the reads does not spin."""
        disk = self.disk
        if disk is not None:
            timeout = IDLE_WAIT_S if idle and self._pending_reads else 0
            while True:
                try:
                    kind, name, ok, seconds = disk.done.get(timeout=timeout)
                except queue.Empty:
                    break
                timeout = 0
                if kind == "read":
                    self._pending_reads -= 1
                    (self._report.reads_done if ok else self._report.reads_failed).append(name)
                    self._report.read_s.append(seconds)
                elif ok:
                    self._report.write_s.append(seconds)
                else:
                    self._report.writes_dropped.append(name)
        report = self._report
        if not (report.reads_done or report.reads_failed or report.writes_dropped
                or report.copy_s or report.write_s):  # fmt: skip
            return None
        self._report = KVReport()
        return report

    def load_s_per_block(self) -> float:
        """Measured now: seconds a host -> device copy of one block takes."""
        n = min(self.num_host_blocks, 32, self.kv.num_blocks)
        blocks, slots = list(range(n)), list(range(n))
        self._copy(blocks, slots, to_host=False)  # once to warm up
        start = time.perf_counter()
        for _ in range(3):
            self._copy(blocks, slots, to_host=False)
        if self._stream is not None:
            self._stream.synchronize()
        # The device cache is zeroed memory still: nothing a sequence owns was touched.
        for t in self.kv.keys + self.kv.values:
            t[:n].zero_()
        return (time.perf_counter() - start) / (3 * n)


def compute_s_per_token(runner: Any, num_tokens: int = 128) -> float:
    """Measured now: seconds a prompt piece of ``num_tokens`` takes per token, on the
    scratch block (as :meth:`ModelRunner.warm_up` runs it)."""
    from .batch import INDEX_DTYPE, HostBatch

    bs, scratch = runner.block_size, runner.kv_cache.scratch_block
    num_tokens = min(num_tokens, runner.model.cos_sin.shape[0])
    positions = torch.arange(num_tokens, dtype=INDEX_DTYPE)
    host = HostBatch(
        input_ids=torch.full((num_tokens,), runner.pad_token_id, dtype=INDEX_DTYPE),
        positions=positions,
        slot_mapping=scratch * bs + positions % bs,
        logits_indices=torch.tensor([num_tokens - 1], dtype=INDEX_DTYPE),
        seq_lens=torch.tensor([num_tokens], dtype=INDEX_DTYPE),
        query_start_loc=torch.tensor([0, num_tokens], dtype=INDEX_DTYPE),
        block_tables=torch.full((1, -(-num_tokens // bs)), scratch, dtype=INDEX_DTYPE),
        sample_entries=[],
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )
    runner.forward(host, replay=False)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    runner.forward(host, replay=False)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / num_tokens


class TieredExecutor:
    """A rank's executor with KV tiers: the plan's transfers before its rows, the
    disk's reports after them; everything else is the runner's."""

    def __init__(self, runner: Any, tiers: RankTiers):
        self.runner = runner
        self.tiers = tiers
        self._costs = (tiers.load_s_per_block(), compute_s_per_token(runner))

    def execute(self, plan: StepPlan) -> StepResult:
        self.tiers.begin(plan.kv)
        result = self.runner.execute(plan)
        result.kv = self.tiers.report(idle=not plan.scheduled and not plan.padding_slots)
        return result

    def kv_tier_info(self) -> dict:
        """What the engine needs of this rank's tiers: sizes, costs, the disk's files."""
        disk = self.tiers.disk
        return {
            "num_host_blocks": self.tiers.num_host_blocks,
            "block_bytes": self.tiers.block_bytes,
            "load_s_per_block": self._costs[0],
            "compute_s_per_token": self._costs[1],
            "disk": disk.scan() if disk is not None else [],
        }

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def with_kv_tiers(runner: Any, config: Any, rank: int, world_size: int,
                  runtime: dict | None) -> Any:  # fmt: skip
    """``runner`` with the tiers ``config`` asks for (``kv_offloading_size`` GiB of
    host memory in all across the ranks, ``kv_disk_cache_dir``), or as it is."""
    if not config.kv_offloading_size or not config.scheduler.prefix_caching:
        return runner
    kv = runner.kv_cache
    t = kv.keys[0]
    rank_block_bytes = 2 * len(kv.keys) * t[0].numel() * t.element_size()
    num_host = int(config.kv_offloading_size * (1 << 30)) // (rank_block_bytes * world_size)
    if num_host <= 0:
        return runner
    tiers = RankTiers(kv, num_host)
    if config.kv_disk_cache_dir:
        fp = fingerprint(config.model_path, runtime=runtime, dtype=str(t.dtype),
                         kernel_backend=runner.ops.name, block_size=kv.block_size,
                         tp_size=world_size)  # fmt: skip
        tiers.disk = DiskShard(config.kv_disk_cache_dir, fp, rank, rank_block_bytes,
                               max_queue=max(64, min(MAX_WRITE_QUEUE, num_host // 4)))  # fmt: skip
    return TieredExecutor(runner, tiers)
