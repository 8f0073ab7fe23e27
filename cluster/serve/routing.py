"""Which engine replica a request goes to: the one likely to hold its prefix.

Each replica caches the KV of the prompts it computed, so a request whose first
blocks another request sent to replica ``r`` already carried is cheapest on
``r``. The router keeps, per ingress, a bounded map from a block's content hash
(the hashes the engines cache under, :func:`prompt_block_hashes`) to the replica
that last took a prompt with that block. For a new prompt it looks for the
longest run of its first blocks the map knows, and sends it to that replica,
unless that replica is busier than the least loaded one by more than the slack
(then, and when nothing matches, the least loaded replica takes it). Either
way the prompt's blocks are recorded as the chosen replica's.

A request on a LoRA adapter hashes its blocks with the adapter's name mixed in
(an engine never shares KV across adapters either), and when none of its blocks
is known it goes to the replica that last took that adapter, within the same
bound: that replica likely holds the adapter in a slot, and loading it on
another would evict one there.

The map is a guess: a replica may have evicted a block since, and another
ingress's requests are not seen. A wrong guess costs only the recompute that
load-only routing would have paid anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from ...scheduler.block_hash import prompt_block_hashes

ROUTINGS = ("prefix", "load")  # the ingress's choices: this router, or load alone
MAX_BLOCKS = 64  # a prompt's first blocks that are hashed: its shared head, not its tail
CAPACITY = 1 << 16  # block hashes remembered per ingress (~10 MB at most)
ABS_SLACK = 8  # requests in flight a prefix's replica may carry beyond the least loaded ...
REL_SLACK = 0.5  # ... or this fraction of the least loaded's load, whichever is more


def choose_replica(
    router: PrefixRouter | None,
    token_ids: Sequence[int],
    loads: Mapping[str, int],
    adapter: str | None = None,
) -> str:
    """The replica (a key of ``loads``: requests in flight per live replica) for a
    prompt (on LoRA ``adapter``, if any): by ``router``, or with None by load alone
    (the fewest in flight)."""
    if router is None:
        return min(loads, key=loads.__getitem__)
    return router.pick(token_ids, loads, adapter=adapter)


class PrefixRouter:
    """Chooses a replica per prompt by cached prefix, with load as the bound."""

    def __init__(
        self,
        block_size: int,
        *,
        max_blocks: int = MAX_BLOCKS,
        capacity: int = CAPACITY,
        abs_slack: int = ABS_SLACK,
        rel_slack: float = REL_SLACK,
    ):
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.capacity = capacity
        self.abs_slack = abs_slack
        self.rel_slack = rel_slack
        self.owners: OrderedDict[bytes, str] = OrderedDict()  # block hash -> replica, LRU
        self.adapter_owners: OrderedDict[str, str] = OrderedDict()  # adapter -> last replica
        self.num_routed = 0
        self.num_prefix_routed = 0  # sent to the replica holding their prefix
        self.num_adapter_routed = 0  # sent to the replica that last took their adapter

    def pick(self, token_ids: Sequence[int], loads: Mapping[str, int], salt: str = "",
             adapter: str | None = None) -> str:  # fmt: skip
        """The replica (a key of ``loads``, which maps each live replica to its
        requests in flight) that should take a prompt of ``token_ids`` (on LoRA
        ``adapter``, if any)."""
        least = min(loads, key=loads.__getitem__)
        if len(loads) == 1:
            return least
        if adapter is not None:
            salt = f"lora:{adapter}:{salt}"
        hashes = prompt_block_hashes(
            token_ids, self.block_size, salt=salt, max_blocks=self.max_blocks
        )
        bound = loads[least] + max(self.abs_slack, self.rel_slack * loads[least])
        choice, matched = least, False
        for h in reversed(hashes):  # a block's hash covers every block before it
            owner = self.owners.get(h)
            if owner is None or owner not in loads:
                continue
            matched = True
            if loads[owner] <= bound:
                choice = owner
                self.num_prefix_routed += 1
            break
        if adapter is not None and not matched:
            owner = self.adapter_owners.get(adapter)
            if owner in loads and loads[owner] <= bound:
                choice = owner
                self.num_adapter_routed += 1
        self.num_routed += 1
        self._record(hashes, choice)
        if adapter is not None:
            self.adapter_owners[adapter] = choice
            self.adapter_owners.move_to_end(adapter)
            while len(self.adapter_owners) > self.capacity:
                self.adapter_owners.popitem(last=False)
        return choice

    def forget(self, replica: str) -> int:
        """Drops every block recorded as ``replica``'s (it is gone, dead or
        draining); returns how many."""
        gone = [h for h, owner in self.owners.items() if owner == replica]
        for h in gone:
            del self.owners[h]
        return len(gone)

    def _record(self, hashes: list[bytes], replica: str) -> None:
        owners = self.owners
        for h in hashes:
            owners[h] = replica
            owners.move_to_end(h)
        while len(owners) > self.capacity:
            owners.popitem(last=False)
