"""Prefix-aware routing: a prompt goes where its first blocks went, load permitting."""

from __future__ import annotations

import asyncio

from iterserve.cluster.serve.replicas import ChannelEngineClient
from iterserve.cluster.serve.routing import PrefixRouter

BS = 4
SYSTEM_A = list(range(100, 116))  # four full blocks
SYSTEM_B = list(range(200, 216))


def test_a_prompt_follows_its_shared_prefix_to_the_replica_that_took_it():
    router = PrefixRouter(BS)
    idle = {"r0": 0, "r1": 0}
    assert router.pick(SYSTEM_A + [1, 2], idle) == "r0"  # nothing known: least loaded
    assert router.pick(SYSTEM_B + [3], {"r0": 1, "r1": 0}) == "r1"
    # r0 is now the busier one, but it holds A's blocks.
    assert router.pick(SYSTEM_A + [7, 8, 9], {"r0": 2, "r1": 1}) == "r0"
    assert router.pick(SYSTEM_B + [4, 5], {"r0": 3, "r1": 1}) == "r1"
    assert router.num_prefix_routed == 2 and router.num_routed == 4


def test_the_longest_known_run_of_blocks_wins():
    router = PrefixRouter(BS, abs_slack=2)
    assert router.pick(SYSTEM_A + [1], {"r0": 5, "r1": 0}) == "r1"  # r1: all four blocks
    assert router.pick(SYSTEM_A[:8], {"r0": 0, "r1": 5}) == "r0"  # too busy: r0, two blocks
    # The first two blocks are r0's now, the last two still r1's: the longest run wins.
    assert router.pick(SYSTEM_A + [2], {"r0": 0, "r1": 1}) == "r1"
    assert router.pick(SYSTEM_A[:8] + [3], {"r0": 1, "r1": 1}) == "r1"  # r1 took all four last


def test_imbalance_beyond_the_slack_routes_by_load():
    router = PrefixRouter(BS, abs_slack=2, rel_slack=0.5)
    router.pick(SYSTEM_A, {"r0": 0, "r1": 0})
    assert router.pick(SYSTEM_A + [1], {"r0": 2, "r1": 0}) == "r0"  # within 2
    assert router.pick(SYSTEM_A + [1], {"r0": 3, "r1": 0}) == "r1"  # beyond it
    # Relative slack at high load: 10 + max(2, 5) = 15.
    assert router.pick(SYSTEM_A + [1], {"r0": 10, "r1": 15}) == "r1"  # r1 took it last


def test_a_replica_gone_is_never_chosen_and_a_short_prompt_goes_by_load():
    router = PrefixRouter(BS)
    router.pick(SYSTEM_A, {"r0": 0, "r1": 3})
    assert router.pick(SYSTEM_A, {"r1": 3, "r2": 4}) == "r1"  # r0 was replaced
    assert router.pick([1, 2, 3], {"r1": 3, "r2": 1}) == "r2"  # no full block


def test_the_map_is_bounded_oldest_first():
    router = PrefixRouter(BS, capacity=6)
    router.pick(SYSTEM_A, {"r0": 0, "r1": 0})
    router.pick(SYSTEM_B, {"r0": 1, "r1": 0})
    assert len(router.owners) == 6
    assert router.pick(SYSTEM_A, {"r0": 0, "r1": 0}) == "r0"  # A's last two blocks kept
    assert router.pick(SYSTEM_B[:4], {"r0": 0, "r1": 0}) == "r0"  # B's first block gone


class FakeConnection:
    def __init__(self, replica: str, load: int):
        self.replica, self.load, self.closed = replica, load, False
        self.usable = True
        self.added: list[str] = []

    async def open(self, label, prompt_token_ids, params, priority):
        self.added.append(label)
        self.load += 1
        return label


def client_with(loads: dict[str, int], router: PrefixRouter | None) -> ChannelEngineClient:
    client = ChannelEngineClient(handle=None, router=router)
    client.connections = {r: FakeConnection(r, n) for r, n in loads.items()}
    client._refresher = asyncio.get_running_loop().create_future()  # no refreshing here
    return client


async def test_the_ingress_routes_by_prefix_or_by_load_alone():
    by_prefix = client_with({"r0": 0, "r1": 0}, PrefixRouter(BS))
    by_load = client_with({"r0": 0, "r1": 0}, None)
    for client in (by_prefix, by_load):
        await client.open("a1", SYSTEM_A + [1], {}, 0)
        await client.open("b1", SYSTEM_B + [2], {}, 0)
        await client.open("a2", SYSTEM_A + [3], {}, 0)
        await client.open("a3", SYSTEM_A + [4], {}, 0)
    assert by_prefix.connections["r0"].added == ["a1", "a2", "a3"]
    assert by_load.connections["r0"].added == ["a1", "a2"]  # alternates with the load


def test_a_lora_request_goes_to_the_replica_that_last_took_its_adapter():
    """No block of its prompt known: the replica likely holding the adapter in a
    slot takes it, load permitting; the base model's blocks are not its own."""
    router = PrefixRouter(BS, abs_slack=2)
    router.pick(SYSTEM_A + [1], {"r0": 0, "r1": 0})  # base model on r0
    assert router.pick([9, 9, 9], {"r0": 1, "r1": 0}, adapter="sql") == "r1"
    # Same prompt head as the base request, but on the adapter: r1, not r0.
    assert router.pick(SYSTEM_A + [2], {"r0": 0, "r1": 1}, adapter="sql") == "r1"
    assert router.num_adapter_routed == 1 and router.num_prefix_routed == 0
    # Beyond the slack, by load after all.
    assert router.pick([5, 6, 7, 8, 1], {"r0": 0, "r1": 3}, adapter="sql") == "r0"
    assert router.pick([4, 4, 4], {"r0": 0, "r1": 0}, adapter="chat") == "r0"  # unknown adapter
