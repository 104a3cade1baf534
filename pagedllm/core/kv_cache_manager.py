"""KVCacheManager: which physical blocks each request holds, and prefix-cache lookups."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagedllm.core.block_hash import update_block_hashes
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


class KVCacheManager:
    """Maps requests to KV blocks of one `BlockPool`.

    A request's blocks are in logical order: block i holds token positions
    [i * block_size, (i + 1) * block_size). Contracts:
    - `get_computed_blocks` finds cached blocks but takes no reference;
    - `allocate_slots` either succeeds completely or changes nothing (returns None);
    - `free` returns the blocks to the pool tail-first.
    Prefix-cache stats (`prefix_cache_queries`, `prefix_cache_hits`, in tokens) are
    counted once per admission, when a request gets its first blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # req_id -> blocks held, in logical order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> number of leading blocks already offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 .. 1.0)."""
        return self.block_pool.get_usage()

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of queried tokens served from the prefix cache."""
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: cdiv(num_tokens, block_size)."""
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks from the start of the request.

        Covers at most num_tokens - 1 tokens: the last token is always recomputed so the
        forward pass produces its logits. So a request of exactly k full blocks can hit at
        most k - 1 of them: max_num_blocks = (num_tokens - 1) // block_size.
        Returns (blocks, num_computed_tokens = len(blocks) * block_size); no reference is
        taken (`allocate_slots` touches them). ([], 0) when caching is off.
        """
        if not self.enable_caching or request.num_tokens == 0:
            return [], 0
        block_hashes = update_block_hashes(request, self.block_size)
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       num_new_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Give the request blocks for `num_new_tokens` more tokens; None if the pool can't.

        Layout of the request's tokens after this call:

            | computed (held) | new computed (prefix hits) | new tokens | (unallocated)
            0          num_computed_tokens      + num_new_computed_tokens + num_new_tokens

        Blocks needed in total = cdiv(num_computed_tokens + num_new_computed_tokens +
        num_new_tokens, block_size). The check happens before anything changes, so None
        means no side effects. On success the prefix hits are touched, new blocks are
        appended, and blocks that become full once this step's tokens are written are
        registered in the prefix cache. Returns the newly allocated blocks (not the hits).
        """
        req_id = request.req_id
        held = self.req_to_blocks.get(req_id, [])
        num_tokens_after = (request.num_computed_tokens + num_new_computed_tokens
                            + num_new_tokens)
        num_new_blocks = max(0, self.num_blocks_needed(num_tokens_after) - len(held)
                             - len(new_computed_blocks))
        # Hits that sit in the free queue (ref_cnt 0) leave it when touched, so they are
        # not part of the supply for the new blocks.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None

        is_admission = req_id not in self.req_to_blocks
        if is_admission and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        # Touch before popping new blocks so a hit can't be evicted under our feet.
        self.block_pool.touch(new_computed_blocks)
        held.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        held.extend(new_blocks)
        self.req_to_blocks[req_id] = held
        self._cache_full_blocks(request, held, num_tokens_after)
        return new_blocks

    def fits_after_freeing(self, num_tokens: int, computed_blocks: Sequence[KVCacheBlock],
                           req_ids: Sequence[str]) -> bool:
        """Whether a new request of `num_tokens` tokens with prefix hits `computed_blocks`
        could get its blocks once the requests `req_ids` freed theirs (mirrors
        allocate_slots' check)."""
        blocks = self.block_pool.blocks
        # A block returns to the free queue once all its holders are freed.
        num_held = Counter(b.block_id for req_id in req_ids
                           for b in self.req_to_blocks.get(req_id, ()))
        num_freed = sum(1 for block_id, n in num_held.items()
                        if blocks[block_id].ref_cnt == n)
        # Hits left without a holder sit in the free queue; touching them takes them out
        # of the supply for the new blocks.
        num_evictable_hits = sum(1 for b in computed_blocks
                                 if b.ref_cnt == num_held.get(b.block_id, 0))
        num_new_blocks = self.num_blocks_needed(num_tokens) - len(computed_blocks)
        num_supply = self.get_num_free_blocks() + num_freed - num_evictable_hits
        return num_new_blocks <= num_supply

    def get_swap_in_hits(self, request: Request,
                         num_blocks: int) -> list[KVCacheBlock | None]:
        """For each of a swapped-out request's `num_blocks` blocks: a cached device block
        that already holds it, or None (its host copy must be copied back).

        Only full computed blocks can hit: block i < num_computed_tokens // block_size
        whose hash (its tokens and prefix) is in the prefix cache. That block holds the
        same K/V, whether it is the request's own old block, not yet evicted, or another
        request's. No reference is taken (`allocate_swapped_in` touches the hits).
        """
        hits: list[KVCacheBlock | None] = [None] * num_blocks
        if not self.enable_caching:
            return hits
        block_hashes = update_block_hashes(request, self.block_size)
        num_full = min(request.num_computed_tokens // self.block_size, len(block_hashes),
                       num_blocks)
        for i in range(num_full):
            hits[i] = self.block_pool.get_cached_block(block_hashes[i])
        return hits

    def allocate_swapped_in(self, request: Request, hits: Sequence[KVCacheBlock | None],
                            num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Give a swapped-out request device blocks again; None (no side effects) if the
        pool can't.

            | restored: len(hits) blocks              | new blocks, if any |
            0                      num_computed_tokens  + num_new_tokens

        `hits[i]` (from `get_swap_in_hits`) is touched and used as block i; every other
        restored block is a fresh block the runner fills from the host copy. Fresh full
        blocks are offered to the prefix cache (a hash another block already owns stays
        with that block). Returns all of the request's blocks, in logical order.
        """
        assert request.req_id not in self.req_to_blocks, request
        num_tokens_after = request.num_computed_tokens + num_new_tokens
        num_blocks = max(len(hits), self.num_blocks_needed(num_tokens_after))
        hit_blocks = [b for b in hits if b is not None]
        num_new_blocks = num_blocks - len(hit_blocks)
        # Hits in the free queue leave it when touched: not part of the supply.
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None
        self.block_pool.touch(hit_blocks)
        fresh = iter(self.block_pool.get_new_blocks(num_new_blocks))
        blocks = [b if b is not None else next(fresh) for b in hits]
        blocks.extend(fresh)
        self.req_to_blocks[request.req_id] = blocks
        self._cache_full_blocks(request, blocks, num_tokens_after)
        return blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        """Register blocks full once `num_tokens` tokens are written: num_tokens // B."""
        if not self.enable_caching:
            return
        block_hashes = update_block_hashes(request, self.block_size)
        # Only blocks whose tokens are all known have a hash.
        num_full_blocks = min(num_tokens // self.block_size, len(block_hashes))
        num_cached = self.num_cached_blocks.get(request.req_id, 0)
        if num_full_blocks > num_cached:
            self.block_pool.cache_full_blocks(blocks, block_hashes, num_cached,
                                              num_full_blocks)
            self.num_cached_blocks[request.req_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, last block first (evicted first)."""
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self.num_cached_blocks.pop(request.req_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes when no block is in use; True if done."""
        return self.block_pool.reset_prefix_cache()
