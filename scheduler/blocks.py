"""The paged KV block manager, with blocks shared by content (prefix caching).

Each sequence owns a block table: block ``i`` holds its tokens
``[i * block_size, (i + 1) * block_size)``. Blocks are allocated as tokens are
scheduled and released when the sequence finishes, is aborted or is preempted.
In ``slab`` layout a sequence reserves ``max_model_len`` worth of blocks at its
first allocation (the naive contiguous-slab-per-slot layout), so paged and slab
can be compared on the same engine.

Prefix caching. A full block whose KV is (or is being) computed can be
*registered* under its content hash (:mod:`~iterserve.scheduler.block_hash`).
A new table may then start with cached blocks instead of fresh ones: they are
shared, each table holding one reference. A block is in exactly one of three
places::

    referenced   ref_count > 0, in that many tables (hashed or not)
    evictable    ref_count == 0, hashed: keeps its KV, LRU order, reused on a hit
    free         ref_count == 0, no hash: nothing worth keeping

A fresh block comes from ``free`` first, then from the least recently released
evictable block, whose hash is dropped then (an eviction). A referenced block
is never handed out, so a block another table reads is never overwritten.

Sliding windows. When every layer of the model reads only the last ``window``
positions (``window`` set), a sequence's leading blocks fall out of reach as
it grows: :meth:`free_out_of_window` hands them on while it runs, so a long
generation holds O(window) blocks, not O(length). A table keeps its length
(block ``i`` still stands for positions ``[i * block_size, ...)``), and its
first ``num_freed`` entries are no longer held::

    window 8, block_size 4, next query at 13 (reads 6..13)
    table    [b7 b2 b9 b4]        num_freed 1: b7 handed on, b2 b9 b4 held
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kv_tiers import KVTiers


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: the one formula, used everywhere."""
    return -(-num_tokens // block_size)


def blocks_before_window(pos: int, window: int | None, block_size: int) -> int:
    """Leading blocks a query at position ``pos`` (or later) cannot read under a
    sliding ``window``: it reads positions ``(pos - window, pos]``, so every block
    wholly before ``pos - window + 1`` is out of its reach. ``None``: no window::

        window 5, block_size 4, pos 13: reads 9..13
        blocks:  [0 1 2 3][4 5 6 7][8 9 10 11][12 13 ..]
                  out      out      read
    """
    if not window:
        return 0
    return max(0, pos - window + 1) // block_size


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, *, slab_tokens: int = 0, window: int | None = None
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.slab_tokens = slab_tokens
        self.window = window
        self._free = list(range(num_blocks - 1, -1, -1))  # pop from the end: low ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # content hash -> the block holding it
        self.tables: dict[str, list[int]] = {}
        # Per table: how many of its leading blocks are done with for caching (found
        # in the cache, registered, or left unshared because another block holds
        # the same content). Registration resumes from there.
        self._num_done: dict[str, int] = {}
        # Per table: its leading entries handed on (out of every layer's window), and
        # the earliest position a query of it may still have, which decides them.
        self.num_freed: dict[str, int] = {}
        self._first_query: dict[str, int] = {}
        self.num_evictions = 0
        # The lower tiers (host memory, disk) and the events of every tier; None: none.
        self.tiers: KVTiers | None = None

    @property
    def num_free(self) -> int:
        """Blocks a fresh allocation can take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks some table references."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding registered content, referenced or evictable."""
        return len(self.cached)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def num_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a sequence needs so that ``num_tokens`` of its tokens fit."""
        held = len(self.tables.get(request_id, ()))
        if held * self.block_size >= num_tokens:
            return 0  # the common decode step: the last block still has room
        target = max(num_tokens, self.slab_tokens)
        return max(0, blocks_for(target, self.block_size) - held)

    def lookup(self, hashes: list[bytes], max_blocks: int) -> list[int]:
        """The cached blocks of the longest run of ``hashes`` from the first, at
        most ``max_blocks``."""
        found = []
        cached = self.cached
        for h in hashes[:max_blocks]:
            block = cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def allocate(
        self, request_id: str, num_tokens: int, cached: list[int] | None = None
    ) -> list[int] | None:
        """Grows the table to hold ``num_tokens`` tokens; returns the new block ids,
        or ``None`` (changing nothing) when too few blocks are free. A new table may
        start with ``cached`` blocks (from :meth:`lookup`): they come first, shared.
        An entry ``~slot`` (negative) of ``cached`` is a block in host memory: a fresh
        block takes its hash now, and the plan loads it there before any row."""
        if cached:
            if request_id in self.tables:
                raise RuntimeError(f"{request_id}: cached blocks can only start a table")
            target = max(num_tokens, self.slab_tokens)
            needed = max(0, blocks_for(target, self.block_size) - len(cached))
            # An evictable hit leaves the pool fresh blocks come from: count it too,
            # and a load takes a fresh block.
            revived = sum(1 for b in cached if b < 0 or self.ref_counts[b] == 0)
            if needed + revived > self.num_free:
                return None
            loads = False
            for block in cached:
                if block < 0:
                    loads = True
                    continue
                if self.ref_counts[block] == 0:
                    del self._evictable[block]
                self.ref_counts[block] += 1
            if loads:
                cached = [b if b >= 0 else self._load(~b) for b in cached]
            new = cached + [self._take() for _ in range(needed)]
            self.tables[request_id] = list(new)
            self._num_done[request_id] = len(cached)
            self.num_freed[request_id] = 0
            return new
        needed = self.num_needed(request_id, num_tokens)
        if needed == 0:
            return []
        if needed > self.num_free:
            return None
        new = [self._take() for _ in range(needed)]
        table = self.tables.get(request_id)
        if table is None:
            self.tables[request_id] = new[:]
            self._num_done[request_id] = 0
            self.num_freed[request_id] = 0
        else:
            table.extend(new)
        return new

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            evicted = self.block_hashes[block]
            assert evicted is not None  # an evictable block is a hashed one
            del self.cached[evicted]
            self.block_hashes[block] = None
            self.num_evictions += 1
            if self.tiers is not None:
                self.tiers.device_removed(evicted)
        self.ref_counts[block] = 1
        return block

    def _load(self, slot: int) -> int:
        """A fresh block that takes the content of host ``slot`` (loaded by the plan)."""
        assert self.tiers is not None
        key = self.tiers.host_key[slot]
        assert key is not None and key not in self.cached, "a load of a key held already"
        block = self._take()
        self.cached[key] = block
        self.block_hashes[block] = key
        self.tiers.load(slot, block)
        return block

    def num_registered(self, request_id: str) -> int:
        """Leading blocks of the table already done with for caching."""
        return self._num_done.get(request_id, 0)

    def register(self, request_id: str, hashes: list[bytes], num_full: int) -> list[int]:
        """Registers the table's blocks up to ``num_full`` under ``hashes`` (the
        sequence's block hashes): their KV is computed by a step already planned.
        A block whose content another block holds already stays unshared. Returns
        the indices newly registered when there are tiers to tell (else none)."""
        start = self._num_done.get(request_id, 0)
        if num_full <= start:
            return []
        table = self.tables[request_id]
        cached = self.cached
        new = []
        for i in range(start, num_full):
            block, h = table[i], hashes[i]
            if h not in cached:
                cached[h] = block
                self.block_hashes[block] = h
                new.append(i)
        self._num_done[request_id] = num_full
        return new if self.tiers is not None else []

    def free(self, request_id: str, num_valid_blocks: int | None = None) -> list[int]:
        """Drops the table's references; returns the blocks it still held. A block
        nobody else references becomes evictable when hashed, free otherwise. A
        hashed block at index ``num_valid_blocks`` or beyond will never have its KV
        computed (its step was taken back): its hash goes."""
        blocks = self.tables.pop(request_id, [])
        self._num_done.pop(request_id, None)
        self._first_query.pop(request_id, None)
        first = self.num_freed.pop(request_id, 0)
        hashes = self.block_hashes
        # Last block first: a prefix's later blocks are the ones evicted first.
        for i in range(len(blocks) - 1, first - 1, -1):
            block = blocks[i]
            h = hashes[block]
            if h is not None and num_valid_blocks is not None and i >= num_valid_blocks:
                if self.ref_counts[block] > 1:
                    raise RuntimeError(f"block {block} is shared but was never computed")
                del self.cached[h]
                hashes[block] = None
                if self.tiers is not None:
                    self.tiers.device_removed(h)
            self._release(block)
        return blocks[first:]

    def truncate(self, request_id: str, num_tokens: int) -> list[int]:
        """Drops the table's blocks beyond those holding its first ``num_tokens``
        tokens (positions a step computed for proposals that were rejected); returns
        them. Such blocks are fresh, never shared and never registered (registration
        stops at the known tokens, and a proposal is not known)."""
        table = self.tables[request_id]
        keep = max(blocks_for(num_tokens, self.block_size), self.num_freed[request_id])
        if len(table) <= keep:
            return []
        assert self._num_done[request_id] <= keep, "a proposed position was registered"
        dropped = table[keep:]
        del table[keep:]
        for block in dropped:
            assert self.ref_counts[block] == 1 and self.block_hashes[block] is None
            self._release(block)
        return dropped

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            h = self.block_hashes[block]
            if h is None:
                self._free.append(block)
            else:
                self._evictable[block] = None
                if self.tiers is not None:
                    self.tiers.released(block, h)  # copied down a tier

    def free_out_of_window(self, request_id: str, first_query: int) -> list[int]:
        """Hands on the table's leading blocks that no layer can read from a query at
        ``first_query`` or later (the first position the sequence computes next);
        returns them. Nothing without a window. Register what caching should keep
        first: a handed-on block keeps its hash (evictable) but leaves the table."""
        if self.window is None or request_id not in self.tables:
            return []
        self._first_query[request_id] = first_query
        table, start = self.tables[request_id], self.num_freed[request_id]
        gone = min(blocks_before_window(first_query, self.window, self.block_size), len(table))
        if gone <= start:
            return []
        self.num_freed[request_id] = gone
        for block in table[start:gone]:
            self._release(block)
        return table[start:gone]

    def held(self, request_id: str) -> list[int]:
        """The blocks the table holds: all but those handed on."""
        return self.tables.get(request_id, [])[self.num_freed.get(request_id, 0) :]

    def clear_cache(self) -> None:
        """Forgets every hash: the KV they name is gone (the ranks restarted, or the
        prefix cache is reset)."""
        cleared = list(self.cached)
        for block in self._evictable:
            self._free.append(block)
        self._evictable.clear()
        self.cached.clear()
        self.block_hashes = [None] * self.num_blocks
        for request_id in self._num_done:
            self._num_done[request_id] = len(self.tables[request_id])
        if self.tiers is not None:
            for h in cleared:
                self.tiers.device_removed(h)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def check_integrity(self) -> None:
        """free + evictable + referenced == total; each block's reference count is
        the number of tables holding it; hashes and the cache index agree. A table
        holds exactly the blocks a layer can still read: every block from the first
        within the window of its sequence's next query on, none before."""
        refs = [0] * self.num_blocks
        for request_id, table in self.tables.items():
            first = self.num_freed[request_id]
            reach = blocks_before_window(
                self._first_query.get(request_id, 0), self.window, self.block_size
            )
            assert first == min(reach, len(table)), (
                f"{request_id}: {first} blocks handed on, but {reach} are out of the window"
            )
            held = table[first:]
            assert len(set(held)) == len(held), f"{request_id} holds a block twice"
            assert self._num_done[request_id] <= len(table), "registered beyond the table"
            for block in held:
                refs[block] += 1
        assert refs == self.ref_counts, "reference counts disagree with the tables"
        assert self._num_done.keys() == self.tables.keys(), "registration state leaked"
        assert self.num_freed.keys() == self.tables.keys(), "window state leaked"
        assert self._first_query.keys() <= self.tables.keys(), "window state leaked"
        free_set, evictable = set(self._free), set(self._evictable)
        assert len(free_set) == len(self._free), "a block is free twice"
        assert not free_set & evictable, "a block is both free and evictable"
        used = {b for b in range(self.num_blocks) if refs[b]}
        assert not used & (free_set | evictable), "a referenced block is free or evictable"
        assert len(used) + len(free_set) + len(evictable) == self.num_blocks, "blocks lost"
        assert all(self.block_hashes[b] is None for b in free_set), "a free block keeps a hash"
        assert all(self.block_hashes[b] is not None for b in evictable), (
            "an evictable block lost its hash"
        )
        index = {h: b for b, h in enumerate(self.block_hashes) if h is not None}
        assert index == self.cached, "the cache index disagrees with the blocks' hashes"
