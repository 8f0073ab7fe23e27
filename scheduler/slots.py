"""The slot table: ``max_num_seqs`` rows; a running sequence keeps its row."""

from __future__ import annotations


class SlotTable:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        # Pop from the end: low slot indices are handed out first.
        self._free = list(range(num_slots - 1, -1, -1))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def acquire(self, request_id: str) -> int:
        slot_idx = self._free.pop()
        self._owner[slot_idx] = request_id
        return slot_idx

    def release(self, slot_idx: int) -> None:
        del self._owner[slot_idx]
        self._free.append(slot_idx)

    def owner(self, slot_idx: int) -> str | None:
        return self._owner.get(slot_idx)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is free twice"
        assert not free & self._owner.keys(), "a slot is both free and owned"
        assert len(free) + len(self._owner) == self.num_slots, "slots lost"
