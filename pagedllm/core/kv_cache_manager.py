"""KVCacheManager: which physical blocks each request holds, and prefix-cache lookups."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagedllm.core.block_hash import BlockHash, update_block_hashes
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_events import KVCacheEvent, drain, stored_runs
from pagedllm.core.kv_groups import cdiv, max_blocks_per_request, num_skipped_blocks
from pagedllm.core.kv_residency import BlockResidency, ResidencyEvent
from pagedllm.request import Request

GroupBlocks = list[list[KVCacheBlock]]
"""A request's blocks, one list per KV cache group, each in logical order."""


def group_block_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a block of `group`: the same tokens hold different layers'
    K/V in different groups, so the groups' keys must differ (group 0 keeps the plain
    hash)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


class KVCacheManager:
    """Maps requests to KV blocks of one `BlockPool`, per KV cache group
    (core/kv_groups.py; a model without sliding windows has one group).

    A request's blocks of a group are in logical order: block i holds token positions
    [i * block_size, (i + 1) * block_size). In a group with a sliding window the blocks
    that fell out of the window are the null block. Contracts:
    - `get_computed_blocks` finds cached blocks but takes no reference;
    - `allocate_slots` either succeeds completely or changes nothing but giving back
      blocks out of the window (returns None);
    - `free` returns the blocks to the pool tail-first.
    Prefix-cache stats (`prefix_cache_queries`, `prefix_cache_hits`, in tokens) are
    counted once per admission, when a request gets its first blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 group_windows: Sequence[int | None] = (None,),
                 hash_prompt_rows: bool = False, enable_kv_events: bool = False,
                 residency_sample_rate: float = 0.0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # The model computes prompt rows on other kernels than generated ones (the
        # runner's `splits_prompt_rows`): block hashes tell them apart (block_hash.py).
        self.hash_prompt_rows = hash_prompt_rows
        # Per KV cache group: the sliding window of its layers (None: full attention).
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        # KV cache events since the last `take_events` (None: not recorded).
        self.events: list[KVCacheEvent] | None = (
            [] if enable_kv_events and enable_caching else None)
        # vLLM's kv_cache_metrics: a sample of blocks' stays (None: off).
        self.residency = (BlockResidency(residency_sample_rate)
                          if residency_sample_rate > 0 else None)
        self.block_pool = BlockPool(num_blocks, enable_caching, self.events, self.residency)
        self.null_block = self.block_pool.null_block
        # req_id -> blocks held, per group, in logical order.
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        # req_id -> number of leading blocks already offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The request's hashes of its full blocks (computed as its tokens come)."""
        return update_block_hashes(request, self.block_size,
                                   prompt_rows=self.hash_prompt_rows)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 .. 1.0)."""
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks of one group that hold `num_tokens` tokens: cdiv(num_tokens, block_size)."""
        return cdiv(num_tokens, self.block_size)

    def num_blocks_for_prompt(self, num_tokens: int) -> int:
        """Blocks a prompt of `num_tokens` tokens needs at once when prefilled in one step
        (every group holds every position it writes)."""
        return self.num_groups * self.num_blocks_needed(num_tokens)

    def max_num_tokens(self, num_usable_blocks: int) -> int:
        """The most tokens a request may have in the cache: enough that, alone, it can
        always be (re)computed in one chunk, every group holding every position
        (a preempted request is recomputed from scratch)."""
        return num_usable_blocks // self.num_groups * self.block_size

    def num_blocks_to_finish(self, num_tokens: int, blocks: GroupBlocks | None,
                             chunk: int) -> int:
        """Blocks a request still needs, at its peak, to hold `num_tokens` tokens computed
        at most `chunk` at a time, beyond `blocks` (per group: the ones it holds, or its
        prefix hits): a full-attention group one per position; a window group only the
        window's and a chunk's, as it gives back the blocks its queries have passed
        (`max_blocks_per_request`, widened by a chunk)."""
        num_needed = self.num_blocks_needed(num_tokens)
        total = 0
        for g, window in enumerate(self.group_windows):
            have = blocks[g] if blocks else ()
            if window is None:
                total += max(0, num_needed - len(have))
            else:
                peak = max_blocks_per_request(window + chunk, num_tokens, self.block_size)
                total += max(0, peak - sum(1 for b in have if not b.is_null))
        return total

    def get_blocks(self, req_id: str, group: int = 0) -> list[KVCacheBlock]:
        """The request's blocks of one group ([] when it holds none)."""
        blocks = self.req_to_blocks.get(req_id)
        return blocks[group] if blocks is not None else []

    def get_block_ids(self, req_id: str) -> list[list[int]]:
        """Per group, the request's block ids (0 where a window group freed one)."""
        groups = self.req_to_blocks.get(req_id) or [[] for _ in self.group_windows]
        return [[b.block_id for b in blocks] for blocks in groups]

    def num_held_blocks(self, req_id: str) -> int:
        """Blocks the request holds, over every group (null entries not counted)."""
        return sum(1 for blocks in self.req_to_blocks.get(req_id, ()) for b in blocks
                   if not b.is_null)

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest prefix of the request served by cached blocks, in every group.

        Covers at most num_tokens - 1 tokens: the last token is always recomputed so the
        forward pass produces its logits. So a request of exactly k full blocks can hit at
        most k - 1 of them: max_num_blocks = (num_tokens - 1) // block_size.
        A full-attention group needs all of the first k blocks cached; a window group
        only those its next query still sees (null blocks in place of the others).
        Returns (blocks per group, num_computed_tokens = k * block_size); no reference is
        taken (`allocate_slots` touches them). ([[]...], 0) when caching is off.
        """
        empty: GroupBlocks = [[] for _ in self.group_windows]
        if not self.enable_caching or request.num_tokens == 0:
            return empty, 0
        block_hashes = self.block_hashes(request)
        num_hit = min((request.num_tokens - 1) // self.block_size, len(block_hashes))
        # cached[g][i]: block i of group g. A full group's run stops at its first miss
        # (the waiting head is looked up again every step while it does not fit).
        cached: list[list[KVCacheBlock | None]] = [[] for _ in self.group_windows]
        for g, window in enumerate(self.group_windows):
            if window is None:
                for h in block_hashes[:num_hit]:
                    block = self.block_pool.get_cached_block(group_block_hash(h, g))
                    if block is None:
                        break
                    cached[g].append(block)
                num_hit = len(cached[g])
        for g, window in enumerate(self.group_windows):
            if window is not None:
                cached[g] = [self.block_pool.get_cached_block(group_block_hash(h, g))
                             for h in block_hashes[:num_hit]]
        while num_hit > 0 and not all(
                self._window_hit(cached[g], num_hit, w)
                for g, w in enumerate(self.group_windows) if w is not None):
            num_hit -= 1
        if num_hit == 0:
            return empty, 0
        blocks: GroupBlocks = []
        for g, window in enumerate(self.group_windows):
            skip = num_skipped_blocks(num_hit * self.block_size, window, self.block_size)
            blocks.append([self.null_block] * skip + cached[g][skip:num_hit])
        return blocks, num_hit * self.block_size

    def _window_hit(self, cached: list[KVCacheBlock | None], num_blocks: int,
                    window: int) -> bool:
        """Whether a window group has the blocks the query after `num_blocks` full
        blocks sees."""
        skip = num_skipped_blocks(num_blocks * self.block_size, window, self.block_size)
        return all(b is not None for b in cached[skip:num_blocks])

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: GroupBlocks | None = None,
                       num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0,
                       num_external_tokens: int = 0,
                       reserve_blocks: int = 0) -> GroupBlocks | None:
        """Give the request blocks for `num_new_tokens` more tokens; None if the pool can't.

        Layout of the request's tokens after this call:

            | computed (held) | new computed (prefix hits) | new tokens | (unallocated)
            0          num_computed_tokens      + num_new_computed_tokens + num_new_tokens

        Each group needs cdiv(num_computed_tokens + num_new_computed_tokens +
        num_new_tokens, block_size) entries, of which a window group's leading ones out
        of the window are the null block: first the held ones are given back (always
        safe: no query reads them again), then the check, so None means nothing else
        changed. On success the prefix hits are touched, new blocks are appended, and
        blocks that become full once this step's tokens are written are registered in
        the prefix cache. Returns, per group, the entries appended (hits excluded; null
        entries included, so block ids line up with positions).
        `num_lookahead_tokens` more slots are allocated past the new tokens (speculative
        decoding: a draft model's proposals) but never cached.
        The last `num_external_tokens` of the new computed tokens come from outside the
        pool (the KV store, core/kv_store.py): no hits cover them, so their blocks are
        new ones, the first appended (the caller has them filled before any step reads
        them); the prefix-cache stats do not count them as hits. `reserve_blocks`: the
        pool must keep that many free after the call (the scheduler's watermark).
        """
        req_id = request.req_id
        held = self.req_to_blocks.get(req_id)
        if held is None:
            held = [[] for _ in self.group_windows]
        hits = new_computed_blocks or [[] for _ in self.group_windows]
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_after = num_computed + num_new_tokens
        num_needed = self.num_blocks_needed(num_tokens_after + num_lookahead_tokens)
        skips = [num_skipped_blocks(num_computed, w, self.block_size)
                 for w in self.group_windows]
        for blocks, skip in zip(held, skips):
            self._free_skipped(blocks, skip)
        # Per group: new entries, of which the leading ones below the skip are null.
        num_entries = [max(0, num_needed - len(h) - len(c)) for h, c in zip(held, hits)]
        num_null = [max(0, min(n, skip - len(h) - len(c)))
                    for n, skip, h, c in zip(num_entries, skips, held, hits)]
        num_new_blocks = sum(num_entries) - sum(num_null)
        hit_blocks = [b for group in hits for b in group if not b.is_null]
        # Hits that sit in the free queue (ref_cnt 0) leave it when touched, so they are
        # not part of the supply for the new blocks.
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if (num_new_blocks + reserve_blocks
                > self.block_pool.get_num_free_blocks() - num_evictable_hits):
            return None

        is_admission = req_id not in self.req_to_blocks
        if is_admission and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens - num_external_tokens
        # Touch before popping new blocks so a hit can't be evicted under our feet.
        self.block_pool.touch(hit_blocks)
        fresh = iter(self.block_pool.get_new_blocks(num_new_blocks))
        appended: GroupBlocks = []
        for blocks, group_hits, n, nulls in zip(held, hits, num_entries, num_null):
            blocks.extend(group_hits)
            new = [self.null_block] * nulls + [next(fresh) for _ in range(n - nulls)]
            blocks.extend(new)
            appended.append(new)
        self.req_to_blocks[req_id] = held
        self._cache_full_blocks(request, held, num_tokens_after)
        return appended

    def _free_skipped(self, blocks: list[KVCacheBlock], skip: int) -> None:
        """Give back a window group's blocks below `skip`, null in their place (those of
        a full-attention group never are: its skip is 0)."""
        freed = []
        for i in range(min(skip, len(blocks))):
            if not blocks[i].is_null:
                freed.append(blocks[i])
                blocks[i] = self.null_block
        # Oldest last: a freed block nobody shares is evicted before newer ones.
        self.block_pool.free_blocks(reversed(freed))

    def fits_after_freeing(self, num_tokens: int, computed_blocks: GroupBlocks,
                           req_ids: Sequence[str], reserve_blocks: int = 0) -> bool:
        """Whether a new request of `num_tokens` tokens with prefix hits `computed_blocks`
        could get its blocks, leaving `reserve_blocks` free, once the requests `req_ids`
        freed theirs (mirrors allocate_slots' check)."""
        blocks = self.block_pool.blocks
        # A block returns to the free queue once all its holders are freed.
        num_held = Counter(b.block_id for req_id in req_ids
                           for group in self.req_to_blocks.get(req_id, ()) for b in group
                           if not b.is_null)
        num_freed = sum(1 for block_id, n in num_held.items()
                        if blocks[block_id].ref_cnt == n)
        hit_blocks = [b for group in computed_blocks for b in group if not b.is_null]
        # Hits left without a holder sit in the free queue; touching them takes them out
        # of the supply for the new blocks.
        num_evictable_hits = sum(1 for b in hit_blocks
                                 if b.ref_cnt == num_held.get(b.block_id, 0))
        num_computed = max((len(g) for g in computed_blocks), default=0) * self.block_size
        num_needed = self.num_blocks_needed(num_tokens)
        num_new_blocks = 0
        for window, group in zip(self.group_windows, computed_blocks or
                                 [[] for _ in self.group_windows]):
            skip = num_skipped_blocks(num_computed, window, self.block_size)
            num_new_blocks += num_needed - max(len(group), skip)
        num_supply = self.get_num_free_blocks() + num_freed - num_evictable_hits
        return num_new_blocks + reserve_blocks <= num_supply

    def get_swap_in_hits(self, request: Request,
                         num_blocks: Sequence[int]) -> GroupBlocks | list[list[None]]:
        """For each of a swapped-out request's blocks (`num_blocks[g]` in group g): a
        cached device block that already holds it, the null block where a window group
        holds none, or None (its host copy must be copied back).

        Only full computed blocks can hit: block i < num_computed_tokens // block_size
        whose hash (its tokens and prefix) is in the prefix cache. That block holds the
        same K/V, whether it is the request's own old block, not yet evicted, or another
        request's. No reference is taken (`allocate_swapped_in` touches the hits).
        """
        hits: list[list[KVCacheBlock | None]] = []
        block_hashes = self.block_hashes(request) if self.enable_caching else []
        for g, (window, n) in enumerate(zip(self.group_windows, num_blocks)):
            skip = num_skipped_blocks(request.num_computed_tokens, window, self.block_size)
            group: list[KVCacheBlock | None] = [self.null_block] * min(skip, n)
            num_full = min(request.num_computed_tokens // self.block_size,
                           len(block_hashes), n)
            for i in range(len(group), n):
                group.append(self.block_pool.get_cached_block(
                    group_block_hash(block_hashes[i], g)) if i < num_full else None)
            hits.append(group)
        return hits

    def allocate_swapped_in(self, request: Request,
                            hits: Sequence[Sequence[KVCacheBlock | None]],
                            num_new_tokens: int, reserve_blocks: int = 0,
                            ) -> GroupBlocks | None:
        """Give a swapped-out request device blocks again; None (no side effects) if the
        pool can't.

            | restored: len(hits[g]) entries          | new blocks, if any |
            0                      num_computed_tokens  + num_new_tokens

        `hits[g][i]` (from `get_swap_in_hits`) is touched and used as block i (the null
        block stays null); every other restored block is a fresh block the runner fills
        from the host copy. Fresh full blocks are offered to the prefix cache (a hash
        another block already owns stays with that block). Returns all of the request's
        blocks, per group, in logical order.
        """
        assert request.req_id not in self.req_to_blocks, request
        num_tokens_after = request.num_computed_tokens + num_new_tokens
        num_needed = self.num_blocks_needed(num_tokens_after)
        hit_blocks = [b for group in hits for b in group if b is not None and not b.is_null]
        num_new_blocks = sum(max(len(group), num_needed) - len(group) for group in hits)
        num_new_blocks += sum(1 for group in hits for b in group if b is None)
        # Hits in the free queue leave it when touched: not part of the supply.
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if (num_new_blocks + reserve_blocks
                > self.block_pool.get_num_free_blocks() - num_evictable_hits):
            return None
        self.block_pool.touch(hit_blocks)
        fresh = iter(self.block_pool.get_new_blocks(num_new_blocks))
        blocks: GroupBlocks = []
        for group in hits:
            restored = [b if b is not None else next(fresh) for b in group]
            restored.extend(next(fresh) for _ in range(num_needed - len(group)))
            blocks.append(restored)
        self.req_to_blocks[request.req_id] = blocks
        self._cache_full_blocks(request, blocks, num_tokens_after)
        return blocks

    def _cache_full_blocks(self, request: Request, blocks: GroupBlocks,
                           num_tokens: int) -> None:
        """Register blocks full once `num_tokens` tokens are written: num_tokens // B."""
        if not self.enable_caching:
            return
        block_hashes = self.block_hashes(request)
        # Only blocks whose tokens are all known have a hash.
        num_full_blocks = min(num_tokens // self.block_size, len(block_hashes))
        num_cached = self.num_cached_blocks.get(request.req_id, 0)
        if num_full_blocks <= num_cached:
            return
        for g, group in enumerate(blocks):
            keys = (block_hashes if g == 0
                    else [group_block_hash(h, g) for h in block_hashes[:num_full_blocks]])
            stored = self.block_pool.cache_full_blocks(group, keys, num_cached,
                                                       num_full_blocks)
            if g == 0 and stored and self.events is not None:
                self._record_stored(request, block_hashes, stored)
        self.num_cached_blocks[request.req_id] = num_full_blocks

    def _record_stored(self, request: Request, block_hashes: list[BlockHash],
                       stored: list[int]) -> None:
        """One BlockStored per run of consecutive blocks that entered the cache (group
        0's hashes: the other groups' keys derive from them)."""
        self.events += stored_runs(request, block_hashes, stored, self.block_size)

    def take_residency_events(self) -> list[ResidencyEvent]:
        """The sampled blocks' stays that ended since the last call ([] when off)."""
        return self.residency.drain() if self.residency is not None else []

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events recorded since the last call, removals merged."""
        return drain(self.events)

    def free(self, request: Request, forget: bool = False) -> None:
        """Release all of the request's blocks, last block first (evicted first);
        `forget`: and take them out of the prefix cache (KV computed wrongly)."""
        groups = self.req_to_blocks.pop(request.req_id, [])
        self.num_cached_blocks.pop(request.req_id, None)
        for blocks in groups:
            held = [b for b in reversed(blocks) if not b.is_null]
            if forget:
                self.block_pool.forget(held)
            self.block_pool.free_blocks(held)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes when no block is in use; True if done."""
        return self.block_pool.reset_prefix_cache()
