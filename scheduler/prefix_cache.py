"""Prefix caching: which of a request's blocks are shared by content, and when.

Enabled by ``enable_prefix_caching`` under continuous and chunked batching. A
full block of a prompt (or of a recompute) is registered under its content
hash (:mod:`~iterserve.scheduler.block_hash`) as soon as a planned step
computes it, so a request admitted in the same step can start on it; the
blocks decodes fill are registered when their sequence ends or is preempted,
once their tokens are known (a token a running step samples is not, yet). A
waiting request is admitted on the longest run of its first blocks found
cached, short of its last token (always computed, so that there are logits to
sample), and starts computing there. Finishing, aborting and preempting drop
references and keep the hashes: the blocks wait, evictable, until a fresh
block needs them (:class:`~iterserve.scheduler.blocks.BlockManager` keeps the
reference counts, the hashes and the LRU). A restart of the ranks drops every
hash.
"""

from __future__ import annotations

from .block_hash import prompt_block_hashes
from .blocks import BlockManager
from .request import Request


class PrefixCache:
    """The scheduler's questions to the block manager about shared blocks; with
    ``enabled`` False every answer is "nothing cached" and blocks are only freed."""

    def __init__(self, blocks: BlockManager, block_size: int, enabled: bool):
        self.blocks = blocks
        self.block_size = block_size
        self.enabled = enabled

    def hit(self, request: Request) -> list[int]:
        """The cached blocks a waiting request would start with: the longest run of
        its first blocks, short of its last token, which is always computed. A
        prompt whose logprobs were asked for is computed whole: they come from its
        logits, which a cached block does not keep."""
        if not self.hit_allowed(request):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks == 0:
            return []
        hashes = request.full_block_hashes(self.block_size)
        found = self.blocks.lookup(hashes, max_blocks)
        tiers = self.blocks.tiers
        if tiers is None or len(found) == max_blocks or not tiers.host_slot:
            return found
        # Below the device: a block in host memory is loaded (``~slot``), and a later
        # block may be on the device again (another request's, or loaded before).
        cached, host = self.blocks.cached, tiers.host_slot
        num_loads = 0
        for h in hashes[len(found) : max_blocks]:
            block = cached.get(h)
            if block is None:
                slot = host.get(h)
                if slot is None:
                    break
                block = ~slot
                num_loads += 1
            found.append(block)
        if num_loads and not tiers.load_pays(num_loads):
            return [b for b in found[: next(i for i, b in enumerate(found) if b < 0)]]
        return found

    def hit_allowed(self, request: Request) -> bool:
        """Whether the request may start on cached blocks at all."""
        if not self.enabled:
            return False
        return request.params.prompt_logprobs is None or request.num_output_tokens > 0

    def register(self, request: Request, num_tokens: int | None = None) -> None:
        """Registers the request's full blocks among its first ``num_tokens`` (default:
        those both computed by a planned step and known to the scheduler)."""
        if not self.enabled:
            return
        if num_tokens is None:
            num_tokens = min(request.num_computed_tokens, request.num_tokens)
        num_full = num_tokens // self.block_size
        if num_full > self.blocks.num_registered(request.request_id):
            hashes = request.full_block_hashes(self.block_size)
            new = self.blocks.register(request.request_id, hashes, num_full)
            if new:
                tiers = self.blocks.tiers
                assert tiers is not None
                tiers.registered(request, hashes, new)

    def release(self, request: Request, num_valid_tokens: int) -> list[int]:
        """Drops the request's blocks, registering first those whose KV is computed
        (its first ``num_valid_tokens``); a block registered beyond them loses its
        hash. Returns the blocks."""
        if not self.enabled or request.request_id not in self.blocks.tables:
            return self.blocks.free(request.request_id)
        self.register(request, num_valid_tokens)
        return self.blocks.free(request.request_id, num_valid_tokens // self.block_size)

    def cached_tokens(self, prompt_token_ids: list[int], cache_salt: str = "") -> int:
        """How many leading tokens of a prompt are cached now (whole blocks)."""
        if not self.enabled:
            return 0
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size, salt=cache_salt)
        return len(self.blocks.lookup(hashes, len(hashes))) * self.block_size

    def check_request(self, request: Request) -> None:
        """A running request's registered blocks hold its own content, computed by a
        planned step (their hashes are its hashes); no block beyond them is hashed."""
        blocks = self.blocks
        num_registered = blocks.num_registered(request.request_id)
        assert num_registered * self.block_size <= request.num_computed_tokens
        hashes = request.block_hashes
        table = blocks.table(request.request_id)
        # Entries handed on (out of the window) may name another table's block now.
        for i in range(blocks.num_freed[request.request_id], num_registered):
            h = blocks.block_hashes[table[i]]
            assert h is None or h == hashes[i], f"{request.request_id}: block {i} hash"
        for block in table[max(num_registered, blocks.num_freed[request.request_id]) :]:
            assert blocks.block_hashes[block] is None, "a block is hashed ahead"
