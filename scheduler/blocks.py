"""The paged KV block manager.

Each sequence owns a block table: block ``i`` holds its tokens
``[i * block_size, (i + 1) * block_size)``. Blocks are allocated as tokens are
scheduled and freed when the sequence finishes, is aborted or is preempted.
In ``slab`` layout a sequence reserves ``max_model_len`` worth of blocks at its
first allocation (the naive contiguous-slab-per-slot layout), so paged and slab
can be compared on the same engine.
"""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: the one formula, used everywhere."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, slab_tokens: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.slab_tokens = slab_tokens
        self._free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

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

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grows the table to hold ``num_tokens`` tokens; returns the new block ids,
        or ``None`` (allocating nothing) when too few blocks are free."""
        needed = self.num_needed(request_id, num_tokens)
        if needed == 0:
            return []
        if needed > len(self._free):
            return None
        new = [self._free.pop() for _ in range(needed)]
        self.tables.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> list[int]:
        blocks = self.tables.pop(request_id, [])
        self._free.extend(reversed(blocks))
        return blocks

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def check_integrity(self) -> None:
        """free + used == total, and no block in two tables or both free and used."""
        used = [b for table in self.tables.values() for b in table]
        used_set = set(used)
        free_set = set(self._free)
        assert len(used_set) == len(used), "a block is in two tables"
        assert len(free_set) == len(self._free), "a block is free twice"
        assert not used_set & free_set, "a block is both free and used"
        assert len(used_set) + len(free_set) == self.num_blocks, "blocks lost"
