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
    router: PrefixRouter | None, token_ids: Sequence[int], loads: Mapping[str, int]
) -> str:
    """The replica (a key of ``loads``: requests in flight per live replica) for a
    prompt: by ``router``, or with None by load alone (the fewest in flight)."""
    if router is None:
        return min(loads, key=loads.__getitem__)
    return router.pick(token_ids, loads)


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
        self.num_routed = 0
        self.num_prefix_routed = 0  # sent to the replica holding their prefix

    def pick(self, token_ids: Sequence[int], loads: Mapping[str, int], salt: str = "") -> str:
        """The replica (a key of ``loads``, which maps each live replica to its
        requests in flight) that should take a prompt of ``token_ids``."""
        least = min(loads, key=loads.__getitem__)
        if len(loads) == 1:
            return least
        hashes = prompt_block_hashes(
            token_ids, self.block_size, salt=salt, max_blocks=self.max_blocks
        )
        choice = least
        for h in reversed(hashes):  # a block's hash covers every block before it
            owner = self.owners.get(h)
            if owner is None or owner not in loads:
                continue
            bound = loads[least] + max(self.abs_slack, self.rel_slack * loads[least])
            if loads[owner] <= bound:
                choice = owner
                self.num_prefix_routed += 1
            break
        self.num_routed += 1
        self._record(hashes, choice)
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
