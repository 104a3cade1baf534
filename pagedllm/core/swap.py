"""Swap preemption's bookkeeping: the host block pool and who holds which host block.

Pure Python like the rest of core/: the copies themselves are the runner's, driven by the
`(src, dst)` block id pairs returned here and sent in `SchedulerOutput`.

What crosses to the host (the rule, kept simple and always correct):
- swap-out copies EVERY block of the request, shared prefix blocks included, to fresh
  host blocks, then drops the request's device references (`KVCacheManager.free`). A
  block another request still holds keeps its contents on the device; one whose ref_cnt
  reaches 0 goes to the free queue still cached (its hash kept), evictable as any other.
- swap-in restores block i either by re-referencing a cached device block with block
  i's hash (the old block if nobody evicted it, or an equal one: no copy), or by copying
  the host copy into a fresh device block. So a short trip costs copies only for the
  blocks that were actually evicted, plus the partial last block.
Hashes: hits keep theirs; fresh full blocks are registered under their hash unless
another block already owns it (the hash map never holds two blocks for one hash).
Host blocks are never shared and never cached: each is owned by one swapped request.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request


class SwapSpace:
    """The host block pool of swap preemption and each swapped request's host blocks.

    Host block 0 is never handed out, like the device null block, so the pool has the
    same shape and invariants as the device one (the property tests check both).
    Contracts: `swap_out` needs `can_swap_out`; `swap_in` is all or nothing.
    """

    def __init__(self, num_blocks: int) -> None:
        self.host_pool = BlockPool(num_blocks, enable_caching=False)
        # req_id -> host blocks, in the request's logical block order.
        self.req_to_host_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_swapped_blocks(self) -> int:
        """Host blocks held by swapped-out requests."""
        return self.host_pool.num_blocks - 1 - self.host_pool.get_num_free_blocks()

    def can_swap_out(self, kv: KVCacheManager, request: Request) -> bool:
        """Whether the host pool has a block for every device block of `request` (and it
        has a token left to run, which its swap-in will schedule)."""
        num_blocks = len(kv.req_to_blocks.get(request.req_id, ()))
        return (0 < num_blocks <= self.host_pool.get_num_free_blocks()
                and request.num_computed_tokens < request.num_tokens)

    def swap_out(self, kv: KVCacheManager, request: Request) -> list[tuple[int, int]]:
        """Move a running request's K/V to host blocks; returns (device, host) id pairs.

        The request holds exactly the blocks of its computed tokens (it is not scheduled
        in this step), so cdiv(num_computed_tokens, block_size) blocks cross, the last one
        possibly partial. Its device references are dropped afterwards, tail first.
        """
        blocks = kv.req_to_blocks[request.req_id]
        assert len(blocks) == kv.num_blocks_needed(request.num_computed_tokens), request
        host_blocks = self.host_pool.get_new_blocks(len(blocks))
        self.req_to_host_blocks[request.req_id] = host_blocks
        pairs = [(b.block_id, h.block_id) for b, h in zip(blocks, host_blocks)]
        kv.free(request)
        return pairs

    def swap_in(self, kv: KVCacheManager, request: Request,
                num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Give a swapped request device blocks for its computed tokens plus
        `num_new_tokens`; returns (host, device) pairs to copy, or None (nothing changed)
        when the device pool is short. Its host blocks are freed on success."""
        host_blocks = self.req_to_host_blocks[request.req_id]
        hits = kv.get_swap_in_hits(request, len(host_blocks))
        blocks = kv.allocate_swapped_in(request, hits, num_new_tokens)
        if blocks is None:
            return None
        # Hits need no copy: the device already holds those blocks' K/V.
        pairs = [(h.block_id, b.block_id)
                 for h, b, hit in zip(host_blocks, blocks, hits) if hit is None]
        self.free(request)
        return pairs

    def free(self, request: Request) -> None:
        """Release the request's host blocks (swapped in, or aborted while swapped)."""
        host_blocks = self.req_to_host_blocks.pop(request.req_id, [])
        self.host_pool.free_blocks(reversed(host_blocks))
