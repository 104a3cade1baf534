"""Physical KV blocks, the LRU free queue, and the prefix-cache hash map.

A block is in exactly one of three states:
- in use: ref_cnt > 0 (held by that many requests), not in the free queue;
- free and cached: ref_cnt == 0, in the free queue, still reachable by its hash until it
  is popped for reuse (evicted);
- free and empty: ref_cnt == 0, in the free queue, block_hash None.
Block 0 is the null block: never handed out, never in the free queue (padding rows of
block tables point at it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagedllm.core.block_hash import BlockHash
from pagedllm.core.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from pagedllm.core.kv_residency import BlockResidency


class KVCacheBlock:
    """Metadata of one physical KV block (the K/V tensors live in the model runner)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # Number of requests holding this block.
        self.ref_cnt = 0
        # Hash of the block's tokens and prefix, set once it is full and registered in
        # the prefix cache; cleared when the block is evicted for reuse.
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None when the block is not in it.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, head = next to reuse (least recently freed).

    All operations are O(1) per block, including removing a block from the middle (a
    prefix-cache hit on a free block). Two sentinel nodes avoid end-of-list special cases.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block; raises ValueError when empty."""
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the n head blocks, head first; raises ValueError if < n."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last)."""
        assert block.prev_free_block is None and block.next_free_block is None, (
            f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append blocks in order (the first one is evicted first)."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queue, head first (for tests and invariant checks; O(n))."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """All KV blocks of the cache, the free queue and the block-hash -> block map.

    The pool hands out and takes back blocks and keeps ref counts; deciding which request
    holds which block is the `KVCacheManager`'s job.
    """

    def __init__(self, num_blocks: int, enable_caching: bool,
                 events: list[KVCacheEvent] | None = None,
                 residency: BlockResidency | None = None) -> None:
        assert num_blocks >= 2, "need the null block plus at least one usable block"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # KV cache events (core/kv_events.py), recorded here when asked for: removals
        # and clears; the manager records stores, which need the request's tokens.
        self.events = events
        # Sampled blocks' stays (core/kv_residency.py; None: not tracked).
        self.residency = residency
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        # Block 0 never enters the queue: blocks 1..num_blocks-1 start free, in id order.
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        # Prefix cache: one block per hash (the first one registered wins; a duplicate
        # computed concurrently by another request simply stays unregistered).
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by requests."""
        num_usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / num_usable

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered under this hash, or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head of the free queue, with ref_cnt 1.

        A popped block that is still cached is evicted from the hash map first.
        Raises ValueError when fewer blocks are free (callers check beforehand).
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0 and not block.is_null, block
            self._evict(block)
            block.ref_cnt = 1
            if self.residency is not None:
                self.residency.allocated(block.block_id)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        cached = self.cached_block_hash_to_block.get(block.block_hash)
        if cached is block:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.events is not None:
                self.events.append(BlockRemoved((block.block_hash,)))
        block.block_hash = None

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock],
                          block_hashes: Sequence[BlockHash], num_cached_blocks: int,
                          num_full_blocks: int) -> list[int]:
        """Register blocks[num_cached_blocks:num_full_blocks] under their hashes; return
        the indices registered.

        `blocks` and `block_hashes` are one request's, in logical order (block i holds
        positions [i*B, (i+1)*B)). Blocks already cached (prefix hits) are skipped, and so
        is a block whose hash another block already owns.
        """
        registered: list[int] = []
        if not self.enable_caching:
            return registered
        assert num_full_blocks <= min(len(blocks), len(block_hashes))
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue  # a prefix hit, or a window group's block given back
            block_hash = block_hashes[i]
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            registered.append(i)
        return registered

    def forget(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop these blocks' hashes from the prefix cache (their contents are not what
        the hashes say); references are untouched."""
        for block in blocks:
            self._evict(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (prefix hits); free ones leave the free queue."""
        for block in blocks:
            assert not block.is_null
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if self.residency is not None:
                self.residency.accessed(block.block_id)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in eviction order.

        Blocks whose ref_cnt reaches 0 go to the tail of the free queue in the given
        order, so the first of them is evicted first (callers pass a request's blocks in
        reverse, so the tail of a sequence goes before its shareable prefix).
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0 and not block.is_null, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use. True if done."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        if self.residency is not None:
            self.residency.reset()
        return True
