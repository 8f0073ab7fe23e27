"""Hypothesis state machine over the block manager: reference counts, hashes, eviction,
and blocks handed on once out of a sliding window."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from iterserve.scheduler.block_hash import prompt_block_hashes
from iterserve.scheduler.blocks import BlockManager, blocks_before_window, blocks_for

BS = 2
# Few token values and short prompts: sequences share prefixes often.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=9)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS)
        self.content: dict[str, list[int]] = {}  # request_id -> its tokens so far
        self.computed: dict[str, int] = {}  # request_id -> tokens whose KV is computed
        self.next_id = 0

    def _hashes(self, request_id: str) -> list[bytes]:
        return prompt_block_hashes(self.content[request_id], BS)

    @rule(prompt=tokens)
    def admit(self, prompt):
        bm = self.bm
        request_id = f"r{self.next_id}"
        self.next_id += 1
        hit = bm.lookup(prompt_block_hashes(prompt, BS), (len(prompt) - 1) // BS)
        free_before = list(bm._free)
        lru_before = [b for b in bm._evictable if b not in hit]
        refs_before = list(bm.ref_counts)
        evictions_before = bm.num_evictions
        revived = sum(1 for b in hit if refs_before[b] == 0)
        fresh = blocks_for(len(prompt), BS) - len(hit)
        new = bm.allocate(request_id, len(prompt), hit)
        if new is None:
            assert fresh + revived > len(free_before) + len(lru_before) + revived
            assert bm.ref_counts == refs_before  # a refusal changes nothing
            return
        assert new[: len(hit)] == hit  # cached blocks first, shared
        taken = new[len(hit) :]
        assert all(refs_before[b] == 0 for b in taken), "handed out a referenced block"
        evicted = [b for b in taken if b not in free_before]
        # Fresh blocks come from the free list first, then least recently released.
        assert len(evicted) == max(0, fresh - len(free_before))
        assert evicted == lru_before[: len(evicted)]
        assert bm.num_evictions - evictions_before == len(evicted)
        self.content[request_id] = list(prompt)
        self.computed[request_id] = len(hit) * BS

    @precondition(lambda self: self.content)
    @rule(data=st.data())
    def compute(self, data):
        """A step computes some of a sequence's tokens; their full blocks are registered."""
        request_id = data.draw(st.sampled_from(sorted(self.content)))
        end = data.draw(st.integers(self.computed[request_id], len(self.content[request_id])))
        self.computed[request_id] = end
        self.bm.register(request_id, self._hashes(request_id), end // BS)

    @precondition(lambda self: self.content)
    @rule(data=st.data(), more=tokens)
    def grow(self, data, more):
        request_id = data.draw(st.sampled_from(sorted(self.content)))
        content = self.content[request_id]
        if self.computed[request_id] < len(content):
            return  # only a sequence whose tokens are all computed decodes on
        if self.bm.allocate(request_id, len(content) + len(more)) is not None:
            content.extend(more)

    @precondition(lambda self: self.content)
    @rule(data=st.data(), taken_back=st.booleans())
    def release(self, data, taken_back):
        """Finish, abort or preempt; ``taken_back``: its last step never ran."""
        request_id = data.draw(st.sampled_from(sorted(self.content)))
        valid = self.bm.num_registered(request_id)
        if taken_back and valid > self.bm.num_freed[request_id]:
            shared = [b for b in self.bm.table(request_id)[valid - 1 :]
                      if self.bm.ref_counts[b] > 1]  # fmt: skip
            if not shared:
                valid -= 1  # the last registered block loses its hash
        self.bm.free(request_id, valid)
        del self.content[request_id], self.computed[request_id]

    @rule()
    def workers_restart(self):
        self.bm.clear_cache()
        assert self.bm.num_cached == 0

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check_integrity()
        for request_id, table in bm.tables.items():
            hashes = self._hashes(request_id)
            freed = bm.num_freed[request_id]  # entries handed on may name others' blocks
            for i in range(freed, bm.num_registered(request_id)):
                h = bm.block_hashes[table[i]]
                # A registered block holds this sequence's content, or no hash at all
                # (another block held that content first, or the cache was cleared).
                assert h is None or h == hashes[i]
            for block in table[max(freed, bm.num_registered(request_id)) :]:
                assert bm.block_hashes[block] is None, "a block hashed before it is computed"


class WindowedBlockManagerMachine(BlockManagerMachine):
    """The same, on a model whose every layer reads only the last WINDOW positions."""

    WINDOW = 3

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS, window=self.WINDOW)

    @precondition(lambda self: self.content)
    @rule(data=st.data())
    def slide(self, data):
        """The sequence's next query is at its computed length: the blocks before that
        query's window are handed on, registered first (their KV is computed)."""
        bm = self.bm
        request_id = data.draw(st.sampled_from(sorted(self.content)))
        pos = self.computed[request_id]
        table, before = list(bm.table(request_id)), bm.num_freed[request_id]
        refs_before = list(bm.ref_counts)
        gone = min(blocks_before_window(pos, self.WINDOW, BS), len(table))
        bm.register(request_id, self._hashes(request_id), gone)
        released = bm.free_out_of_window(request_id, pos)
        assert released == table[before:gone]
        assert bm.held(request_id) == table[max(before, gone) :]
        for block in released:
            assert bm.ref_counts[block] == refs_before[block] - 1
            if bm.ref_counts[block] == 0:  # kept for caching when it has a hash
                assert (block in bm._evictable) == (bm.block_hashes[block] is not None)


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip

TestWindowedBlockManager = WindowedBlockManagerMachine.TestCase
TestWindowedBlockManager.settings = TestBlockManager.settings


def test_integrity_check_names_a_block_held_out_of_the_window():
    bm = BlockManager(8, 2, window=3)
    bm.allocate("a", 8)
    bm.free_out_of_window("a", 6)  # reads 4..6: blocks 0 and 1 are out of reach
    assert bm.num_freed["a"] == 2 and bm.held("a") == bm.table("a")[2:]
    bm.check_integrity()
    bm.num_freed["a"] = 1  # as if block 1 were still held: it is not referenced
    try:
        bm.check_integrity()
    except AssertionError as e:
        assert "1 blocks handed on, but 2 are out of the window" in str(e)
    else:
        raise AssertionError("check_integrity missed a block held out of the window")
