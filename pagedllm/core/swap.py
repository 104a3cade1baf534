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
    Contracts: `swap_out` needs `can_swap_out`; `swap_in` is all or nothing. With KV
    cache groups (core/kv_groups.py) a request's host blocks are kept per group; the
    null entries of a window group have no host block (None) and stay null.
    """

    def __init__(self, num_blocks: int) -> None:
        self.host_pool = BlockPool(num_blocks, enable_caching=False)
        # req_id -> per group, host blocks in the request's logical block order (None
        # where the device entry is the null block).
        self.req_to_host_blocks: dict[str, list[list[KVCacheBlock | None]]] = {}

    @property
    def num_swapped_blocks(self) -> int:
        """Host blocks held by swapped-out requests."""
        return self.host_pool.num_blocks - 1 - self.host_pool.get_num_free_blocks()

    def can_swap_out(self, kv: KVCacheManager, request: Request) -> bool:
        """Whether the host pool has a block for every device block of `request` (and it
        has a token left to run, which its swap-in will schedule)."""
        num_blocks = kv.num_held_blocks(request.req_id)
        return (0 < num_blocks <= self.host_pool.get_num_free_blocks()
                and request.num_computed_tokens < request.num_tokens)

    def swap_out(self, kv: KVCacheManager, request: Request) -> list[tuple[int, int]]:
        """Move a running request's K/V to host blocks; returns (device, host) id pairs.

        The blocks of its computed tokens cross: cdiv(num_computed_tokens, block_size)
        entries per group, the last one possibly partial (null entries need no copy).
        Blocks past them (speculative decoding: slots of rejected proposals, lookahead)
        hold nothing of the sequence and are not copied. Its device references are
        dropped afterwards, tail first.
        """
        num_needed = kv.num_blocks_needed(request.num_computed_tokens)
        held = kv.req_to_blocks[request.req_id]
        assert all(len(blocks) >= num_needed for blocks in held), request
        groups = [blocks[:num_needed] for blocks in held]
        num_copies = sum(1 for blocks in groups for b in blocks if not b.is_null)
        fresh = iter(self.host_pool.get_new_blocks(num_copies))
        host_groups = [[None if b.is_null else next(fresh) for b in blocks]
                       for blocks in groups]
        self.req_to_host_blocks[request.req_id] = host_groups
        pairs = [(b.block_id, h.block_id)
                 for blocks, hosts in zip(groups, host_groups)
                 for b, h in zip(blocks, hosts) if h is not None]
        kv.free(request)
        return pairs

    def swap_in(self, kv: KVCacheManager, request: Request, num_new_tokens: int,
                reserve_blocks: int = 0) -> list[tuple[int, int]] | None:
        """Give a swapped request device blocks for its computed tokens plus
        `num_new_tokens`; returns (host, device) pairs to copy, or None (nothing changed)
        when the device pool is short (of them and `reserve_blocks` more). Its host
        blocks are freed on success."""
        host_groups = self.req_to_host_blocks[request.req_id]
        hits = kv.get_swap_in_hits(request, [len(hosts) for hosts in host_groups])
        groups = kv.allocate_swapped_in(request, hits, num_new_tokens, reserve_blocks)
        if groups is None:
            return None
        # Hits need no copy: the device already holds those blocks' K/V. A window
        # group's block out of the window by now needs none either (null on both ends).
        pairs = [(h.block_id, b.block_id)
                 for hosts, blocks, group_hits in zip(host_groups, groups, hits)
                 for h, b, hit in zip(hosts, blocks, group_hits)
                 if hit is None and h is not None]
        self.free(request)
        return pairs

    def free(self, request: Request) -> None:
        """Release the request's host blocks (swapped in, or aborted while swapped)."""
        for hosts in self.req_to_host_blocks.pop(request.req_id, []):
            self.host_pool.free_blocks(h for h in reversed(hosts) if h is not None)
