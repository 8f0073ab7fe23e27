"""LoRA adapters as a scheduled resource: which are known, which are resident.

The ranks hold at most ``max_loras`` adapters at once, in adapter slots
``1..max_loras`` (slot 0 is the base model alone). A running request pins its
adapter's slot from admission until it leaves the running set (finished,
aborted, preempted, retired), so every step mixes at most ``max_loras``
distinct adapters and a slot never changes under a row that uses it::

    admit(request of adapter A)
      A resident            -> its slot, one more pin
      a slot is empty       -> load A there          (plan.adapter_loads)
      an unpinned A' holds one, least recently used first
                            -> evict A', load A there
      every slot is pinned  -> not now: the request waits (others may go first)

A load travels in the plan of the step that first computes the adapter's rows;
the ranks apply it before that step's rows, and every step before it has run
to the end on the ranks by then, so an eviction never reaches a row in flight.

``adapter_id`` names one registration: unloading an adapter and loading one
under the same name gives a new id, so neither the ranks' slots nor the prefix
cache (whose hashes are salted with :attr:`Adapter.cache_salt`) can mistake
one for the other. Pure Python, like the rest of the scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .messages import AdapterLoad


class AdapterNotFoundError(KeyError):
    """A request names an adapter the engine does not know."""


@dataclass(frozen=True, slots=True)
class Adapter:
    """One registered adapter."""

    name: str
    path: str
    adapter_id: int
    base_model_name: str | None = None

    @property
    def cache_salt(self) -> str:
        """What its requests' KV block hashes are salted with: a hit never crosses
        adapters, nor two registrations of one name."""
        return f"lora:{self.adapter_id}:{self.name}"


@dataclass
class AdapterResidency:
    """The registered adapters, and which of them the ranks hold in which slot."""

    max_loras: int
    registered: dict[str, Adapter] = field(default_factory=dict)
    slot_of: dict[int, int] = field(default_factory=dict)  # adapter_id -> slot
    holder: dict[int, Adapter] = field(default_factory=dict)  # slot -> adapter
    pins: dict[int, int] = field(default_factory=dict)  # adapter_id -> running requests
    # Resident adapters nobody pins, least recently used first: the eviction order.
    idle: OrderedDict[int, None] = field(default_factory=OrderedDict)
    pending_loads: list[AdapterLoad] = field(default_factory=list)  # for the next plan
    num_loads: int = 0
    num_evictions: int = 0
    _next_id: int = 1

    # -- the registry -------------------------------------------------------------------

    def register(self, name: str, path: str, base_model_name: str | None = None) -> Adapter:
        if name in self.registered:
            raise ValueError(f"an adapter named {name!r} is loaded already")
        adapter = Adapter(name, path, self._next_id, base_model_name)
        self._next_id += 1
        self.registered[name] = adapter
        return adapter

    def unregister(self, name: str) -> Adapter:
        """Forgets an adapter: new requests cannot name it; the running ones finish
        on it, and its slot is free once the last of them leaves."""
        adapter = self.registered.pop(name, None)
        if adapter is None:
            raise AdapterNotFoundError(name)
        if adapter.adapter_id in self.idle:
            self._evict(adapter.adapter_id)
        return adapter

    def get(self, name: str) -> Adapter:
        adapter = self.registered.get(name)
        if adapter is None:
            raise AdapterNotFoundError(name)
        return adapter

    # -- residency ------------------------------------------------------------------------

    @property
    def num_resident(self) -> int:
        return len(self.slot_of)

    def can_pin(self, adapter: Adapter) -> bool:
        """Whether :meth:`pin` would succeed now."""
        return (
            adapter.adapter_id in self.slot_of
            or len(self.holder) < self.max_loras
            or bool(self.idle)
        )

    def pin(self, adapter: Adapter) -> int | None:
        """The slot ``adapter`` computes in, made resident if need be (a load for the
        next plan, evicting the least recently used idle adapter when every slot
        is taken); None when every slot is pinned by running requests."""
        aid = adapter.adapter_id
        slot = self.slot_of.get(aid)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self.slot_of[aid], self.holder[slot] = slot, adapter
            self.pending_loads.append(AdapterLoad(slot, aid, adapter.name, adapter.path))
            self.num_loads += 1
        self.idle.pop(aid, None)
        self.pins[aid] = self.pins.get(aid, 0) + 1
        return slot

    def unpin(self, adapter_id: int) -> None:
        """A running request of this adapter left the running set."""
        left = self.pins[adapter_id] - 1
        if left:
            self.pins[adapter_id] = left
            return
        del self.pins[adapter_id]
        slot = self.slot_of[adapter_id]
        if self.holder[slot].name in self.registered and (
            self.registered[self.holder[slot].name].adapter_id == adapter_id
        ):
            self.idle[adapter_id] = None  # most recently used last
        else:  # unloaded while it ran: nothing will use it again
            self._evict(adapter_id)

    def take_loads(self) -> list[AdapterLoad]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def forget_resident(self) -> None:
        """The ranks were restarted: they hold no adapter. Every request was
        preempted first, so nothing is pinned."""
        assert not self.pins, "adapters still pinned by running requests"
        self.slot_of.clear()
        self.holder.clear()
        self.idle.clear()
        self.pending_loads.clear()

    def _free_slot(self) -> int | None:
        for slot in range(1, self.max_loras + 1):
            if slot not in self.holder:
                return slot
        if not self.idle:
            return None
        victim = next(iter(self.idle))
        slot = self.slot_of[victim]
        self._evict(victim)
        return slot

    def _evict(self, adapter_id: int) -> None:
        self.idle.pop(adapter_id, None)
        slot = self.slot_of.pop(adapter_id)
        del self.holder[slot]
        # A load planned for this slot and not sent yet is moot now.
        self.pending_loads = [a for a in self.pending_loads if a.adapter_id != adapter_id]
        self.num_evictions += 1

    def check_integrity(self, running_pins: dict[int, int]) -> None:
        """Pins equal the running requests per adapter; slots, holders and the idle
        order describe the same resident set, within ``max_loras``."""
        assert self.pins == running_pins, f"pins {self.pins} != running {running_pins}"
        assert len(self.holder) == len(self.slot_of) <= self.max_loras
        for slot, adapter in self.holder.items():
            assert self.slot_of[adapter.adapter_id] == slot
            assert 1 <= slot <= self.max_loras
        assert set(self.idle) | set(self.pins) == set(self.slot_of)
        assert not set(self.idle) & set(self.pins)
