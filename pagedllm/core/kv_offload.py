"""A second tier of the prefix cache in host memory (vLLM's --kv-offloading-size, its
OffloadingConnector): which blocks the scheduler copies there and which it loads back.

Pure Python like the rest of core/: the copies are the runners' (worker/kv_offload.py),
driven by the (host slot, block id) pairs of SchedulerOutput, the same fields the
directory store (core/kv_store.py) fills with file names; the scheduler talks to either
through the same calls (lookup, record_loads, plan_saves).

Every full block a step computes, prompt or generated, is copied to a host slot after
the step's forward pass, keyed by its prefix-cache hash (core/block_hash.py), unless the
tier holds that hash already. When the KV cache has evicted a prefix, a request admitted
with it finds the blocks here after its prefix hits and loads them into fresh blocks
before its first forward pass, computing only the rest. Slots are recycled least
recently used first (a hit or a save makes a block the most recent).

Why no copy can be read before it is written, or overwritten before it is read: the
runner executes steps in order, and within a step the loads come before the forward pass
and the saves after it. A hash enters the map when its save is planned, so a later
step's load of it runs after the save; a slot recycled by a step's save may be one the
same step loads from, which the load has read by then. A step plans at most as many
saves as there are slots, so no two of its saves share one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pagedllm.core.block_hash import BlockHash
from pagedllm.core.kv_events import (AllBlocksCleared, BlockRemoved, KVCacheEvent, drain,
                                     stored_runs)
from pagedllm.request import Request

if TYPE_CHECKING:
    from pagedllm.core.block_pool import KVCacheBlock
    from pagedllm.core.kv_cache_manager import KVCacheManager


class HostKVStore:
    """The scheduler's view of the host tier: which hash each slot holds."""

    # The scheduler's store interface (core/kv_store.py): this tier always loads and saves.
    load = True
    save = True

    def __init__(self, num_slots: int, block_size: int, enable_events: bool = False) -> None:
        assert num_slots >= 1, num_slots
        self.num_slots = num_slots
        self.block_size = block_size
        # KV cache events of the tier (medium "CPU"), drained with the cache's; None:
        # not recorded.
        self.events: list[KVCacheEvent] | None = [] if enable_events else None
        # Hash -> slot, least recently used first.
        self.slots: OrderedDict[BlockHash, int] = OrderedDict()
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        # req_id -> index of the first of its blocks not yet saved or found here.
        self.next_block: dict[str, int] = {}
        # Prompt tokens of the requests looked up, and of those found here (vLLM's
        # external_prefix_cache_queries / _hits); blocks loaded and saved since start-up.
        self.queries = 0
        self.hits = 0
        self.num_loaded = 0
        self.num_saved = 0
        self.num_evicted = 0
        # (The directory store's counters; host copies do not fail.)
        self.num_load_failures = 0

    def lookup(self, request: Request, num_hit_tokens: int,
               block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The blocks after a waiting request's `num_hit_tokens` of prefix hits that the
        tier holds, up to the first missing one. Like a prefix hit, never the block of
        the prompt's last token (the step must compute it for its logits)."""
        start = num_hit_tokens // self.block_size
        stop = min((request.num_tokens - 1) // self.block_size, len(block_hashes))
        found = []
        for i in range(start, stop):
            if block_hashes[i] not in self.slots:
                break
            found.append(block_hashes[i])
        return found

    def record_loads(self, request: Request, stored: Sequence[BlockHash],
                     blocks: Sequence[KVCacheBlock]) -> list[tuple[int, int]]:
        """An admitted request's loads: the found blocks' slots into its first new
        `blocks`, as (slot, block id); they become the most recently used."""
        self.queries += request.num_tokens
        self.hits += len(stored) * self.block_size
        self.num_loaded += len(stored)
        for h in stored:
            self.slots.move_to_end(h)
        return [(self.slots[h], b.block_id) for h, b in zip(stored, blocks, strict=False)]

    def plan_saves(self, requests: Mapping[str, Request],
                   num_scheduled_tokens: Mapping[str, int],
                   kv: KVCacheManager) -> list[tuple[int, int]]:
        """The step's saves, as (block id, slot): each full block of a scheduled request
        that is computed once this step has run and that the tier lacks (once per
        hash), at most one per slot."""
        B = self.block_size
        saves: list[tuple[int, int]] = []
        planned: set[BlockHash] = set()
        for req_id, num_tokens in num_scheduled_tokens.items():
            request = requests[req_id]
            # num_computed_tokens: before this step's tokens (schedule() adds them last);
            # a request not seen before starts after its prefix hits and the blocks it
            # loaded from here (cached already).
            first = self.next_block.get(req_id, request.num_computed_tokens // B)
            hashes = kv.block_hashes(request)  # full blocks of known tokens only
            end = min((request.num_computed_tokens + num_tokens) // B, len(hashes))
            if end <= first:
                continue
            self.next_block[req_id] = end
            blocks = kv.get_blocks(req_id)
            stored = []
            for i in range(first, end):
                h = hashes[i]
                if h in self.slots:
                    self.slots.move_to_end(h)
                elif h not in planned and len(saves) < self.num_slots:
                    planned.add(h)
                    saves.append((blocks[i].block_id, self._take_slot(h)))
                    stored.append(i)
            if self.events is not None and stored:
                self.events += stored_runs(request, hashes, stored, B, medium="CPU")
        if len(self.next_block) > 2 * len(requests):  # (finished requests' entries)
            self.next_block = {r: i for r, i in self.next_block.items() if r in requests}
        self.num_saved += len(saves)
        return saves

    def _take_slot(self, block_hash: BlockHash) -> int:
        """A slot for `block_hash`: a free one, or the least recently used one's."""
        if self.free:
            slot = self.free.pop()
        else:
            evicted, slot = self.slots.popitem(last=False)
            self.num_evicted += 1
            if self.events is not None:
                self.events.append(BlockRemoved((evicted,), medium="CPU"))
        self.slots[block_hash] = slot
        return slot

    def forget(self, block_hashes: Sequence[BlockHash]) -> None:
        """(The directory store's: a failed load. Host copies do not fail.)"""

    def clear(self) -> None:
        """Forget every block (reset_prefix_cache with reset_external, sleep, new
        weights): the slots' contents are never read again."""
        self.slots.clear()
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.next_block.clear()
        if self.events is not None:
            # (Its stores still unpublished would follow the cache's own clear.)
            self.events = [AllBlocksCleared()]

    def take_events(self) -> list[KVCacheEvent]:
        """The tier's KV cache events since the last call, removals merged."""
        return drain(self.events)

    def renew_namespace(self, salt: str) -> None:
        """The engine's weights changed: no block held here is this model's K/V."""
        self.clear()
