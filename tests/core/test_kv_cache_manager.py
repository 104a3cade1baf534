"""KVCacheManager on a 10-block pool (block 0 null, 9 usable), block_size 4."""

from __future__ import annotations

import pytest

from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request

BLOCK_SIZE = 4


@pytest.fixture
def manager() -> KVCacheManager:
    return KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def ids(groups: list[list[KVCacheBlock]]) -> list[int]:
    """Block ids of the one group of a manager without sliding windows."""
    (blocks,) = groups
    return [b.block_id for b in blocks]


def ref_cnts(manager: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in manager.block_pool.blocks]


def admit(manager: KVCacheManager, request: Request,
          ) -> tuple[list[list[KVCacheBlock]], int]:
    """What the scheduler does for a waiting request with an unlimited budget."""
    hits, num_computed_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_computed_tokens,
                                        hits, num_computed_tokens)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return hits, num_computed_tokens


def test_allocate_and_prefix_hit(manager, make_request) -> None:
    a = make_request("a", list(range(10)))  # blocks [0..3] [4..7] [8, 9]
    assert manager.get_computed_blocks(a) == ([[]], 0)
    new_blocks = manager.allocate_slots(a, 10)
    assert ids(new_blocks) == [1, 2, 3]
    a.num_computed_tokens = 10
    # The two full blocks are cached, the partial one is not.
    blocks = manager.block_pool.blocks
    assert blocks[1].block_hash == a.block_hashes[0]
    assert blocks[2].block_hash == a.block_hashes[1]
    assert blocks[3].block_hash is None

    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_computed_tokens = manager.get_computed_blocks(b)
    assert ids(hits) == [1, 2] and num_computed_tokens == 8
    new_blocks = manager.allocate_slots(b, 3, hits, num_computed_tokens)
    assert ids(new_blocks) == [4]
    assert manager.get_block_ids("b") == [[1, 2, 4]]
    assert ref_cnts(manager)[:5] == [0, 2, 2, 1, 1]
    assert free_ids(manager) == [5, 6, 7, 8, 9]
    assert manager.prefix_cache_queries == 10 + 11
    assert manager.prefix_cache_hits == 8


def test_last_token_is_always_recomputed(manager, make_request) -> None:
    a = make_request("a", list(range(8)))  # exactly 2 full blocks
    admit(manager, a)
    assert manager.get_block_ids("a") == [[1, 2]]
    b = make_request("b", list(range(8)))
    hits, num_computed_tokens = manager.get_computed_blocks(b)
    # At most num_tokens - 1 = 7 tokens: only the first block can be a hit.
    assert ids(hits) == [1] and num_computed_tokens == 4
    assert ids(manager.allocate_slots(b, 4, hits, 4)) == [3]
    assert manager.get_block_ids("b") == [[1, 3]]
    # One more token and both full blocks hit.
    c = make_request("c", list(range(9)))
    hits, num_computed_tokens = manager.get_computed_blocks(c)
    assert ids(hits) == [1, 2] and num_computed_tokens == 8


def test_freed_blocks_evicted_tail_first_lru(manager, make_request) -> None:
    a = make_request("a", list(range(12)))
    b = make_request("b", list(range(100, 108)))
    admit(manager, a)
    admit(manager, b)
    assert manager.get_block_ids("a") == [[1, 2, 3]]
    assert manager.get_block_ids("b") == [[4, 5]]
    manager.free(a)
    manager.free(b)
    # Never-used blocks first, then a (freed first) tail-first, then b tail-first.
    assert free_ids(manager) == [6, 7, 8, 9, 3, 2, 1, 5, 4]
    assert manager.get_num_free_blocks() == 9 and manager.usage == 0.0

    c = make_request("c", list(range(200, 228)))  # 7 blocks, no hits
    admit(manager, c)
    assert manager.get_block_ids("c") == [[6, 7, 8, 9, 3, 2, 1]]
    assert free_ids(manager) == [5, 4]
    # a's blocks were evicted from the hash map; b's are still cached.
    pool = manager.block_pool
    assert all(pool.get_cached_block(h) is None for h in a.block_hashes)
    b2 = make_request("b2", list(range(100, 108)) + [1])
    hits, num_computed_tokens = manager.get_computed_blocks(b2)
    assert ids(hits) == [4, 5] and num_computed_tokens == 8


def test_hit_on_free_block_is_touched_out_of_queue(manager, make_request) -> None:
    a = make_request("a", list(range(12)))
    admit(manager, a)
    manager.free(a)
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    a2 = make_request("a2", list(range(13)))
    hits, num_computed_tokens = manager.get_computed_blocks(a2)
    assert ids(hits) == [1, 2, 3] and num_computed_tokens == 12
    # Lookup alone takes no reference.
    assert ref_cnts(manager)[1:4] == [0, 0, 0] and manager.get_num_free_blocks() == 9
    assert ids(manager.allocate_slots(a2, 1, hits, 12)) == [4]
    assert ref_cnts(manager)[:5] == [0, 1, 1, 1, 1]
    assert free_ids(manager) == [5, 6, 7, 8, 9]


def test_shared_prefix_ref_counts(manager, make_request) -> None:
    a = make_request("a", list(range(9)))
    b = make_request("b", list(range(9)))
    admit(manager, a)
    admit(manager, b)
    assert manager.get_block_ids("a") == [[1, 2, 3]]
    assert manager.get_block_ids("b") == [[1, 2, 4]]
    assert ref_cnts(manager)[:5] == [0, 2, 2, 1, 1]
    manager.free(a)
    assert ref_cnts(manager)[:5] == [0, 1, 1, 0, 1]
    assert free_ids(manager) == [5, 6, 7, 8, 9, 3]
    manager.free(b)
    assert ref_cnts(manager) == [0] * 10
    assert free_ids(manager) == [5, 6, 7, 8, 9, 3, 4, 2, 1]


def test_decode_grows_blocks_and_caches_them(manager, make_request) -> None:
    a = make_request("a", list(range(3)))
    admit(manager, a)
    assert manager.get_block_ids("a") == [[1]]
    for token in (3, 4):
        a.append_output_token_ids([token])
        new_blocks = manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        if token == 3:
            # Position 3 fills block 1 (no new block) and makes it cacheable.
            assert new_blocks == [[]] and manager.block_pool.blocks[1].block_hash is not None
        else:
            # Position 4 starts logical block 1: cdiv(5, 4) = 2 blocks.
            assert ids(new_blocks) == [2]
    assert manager.get_block_ids("a") == [[1, 2]]
    assert len(manager.block_pool.cached_block_hash_to_block) == 1


def test_chunked_allocation_caches_blocks_as_they_fill(manager, make_request) -> None:
    a = make_request("a", list(range(10)))
    assert ids(manager.allocate_slots(a, 6)) == [1, 2]  # cdiv(6, 4) = 2
    assert len(manager.block_pool.cached_block_hash_to_block) == 1  # 6 // 4
    a.num_computed_tokens = 6
    assert ids(manager.allocate_slots(a, 4)) == [3]  # cdiv(10, 4) = 3
    assert len(manager.block_pool.cached_block_hash_to_block) == 2  # 10 // 4


def test_null_block_never_handed_out(manager, make_request) -> None:
    a = make_request("a", 36)  # 9 blocks: the whole usable pool
    admit(manager, a)
    assert manager.get_block_ids("a") == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert manager.usage == 1.0
    a.append_output_token_ids([0])
    assert manager.allocate_slots(a, 1) is None


def _snapshot(manager: KVCacheManager) -> tuple:
    pool = manager.block_pool
    return (free_ids(manager), ref_cnts(manager), dict(pool.cached_block_hash_to_block),
            {k: ids(v) for k, v in manager.req_to_blocks.items()},
            dict(manager.num_cached_blocks), manager.prefix_cache_queries,
            manager.prefix_cache_hits)


def test_failed_allocation_has_no_side_effects(manager, make_request) -> None:
    a = make_request("a", list(range(12)))
    admit(manager, a)
    manager.free(a)  # blocks 1-3 free but cached
    filler = make_request("filler", list(range(100, 120)))  # 5 blocks: 4..8
    admit(manager, filler)
    assert free_ids(manager) == [9, 3, 2, 1]
    # 3 hits + 2 new blocks: the 4 free blocks include the 3 hits, so only 1 is
    # really available for new blocks.
    b = make_request("b", list(range(12)) + [7, 7, 7, 7, 7])
    hits, num_computed_tokens = manager.get_computed_blocks(b)
    assert ids(hits) == [1, 2, 3]
    before = _snapshot(manager)
    assert manager.allocate_slots(b, 5, hits, num_computed_tokens) is None
    assert _snapshot(manager) == before
    assert "b" not in manager.req_to_blocks
    # A request that fits exactly does succeed.
    c = make_request("c", list(range(12)) + [7])
    hits, num_computed_tokens = manager.get_computed_blocks(c)
    assert ids(manager.allocate_slots(c, 1, hits, num_computed_tokens)) == [9]
    assert manager.get_num_free_blocks() == 0


def test_caching_off(make_request) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=False)
    a = make_request("a", list(range(9)))
    admit(manager, a)
    assert manager.get_block_ids("a") == [[1, 2, 3]]
    assert not manager.block_pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    b = make_request("b", list(range(9)))
    assert manager.get_computed_blocks(b) == ([[]], 0)
    admit(manager, b)
    assert manager.get_block_ids("b") == [[4, 5, 6]]
    assert manager.prefix_cache_queries == 0 and manager.prefix_cache_hits == 0


def test_num_blocks_needed_and_usage(manager, make_request) -> None:
    assert [manager.num_blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    admit(manager, make_request("a", 9))
    assert manager.usage == pytest.approx(3 / 9)
    assert manager.get_block_ids("unknown") == [[]]


def test_window_group_frees_blocks_behind_the_window(make_request) -> None:
    # Groups (full, window 4): block 0 of the window group is given back (null) once
    # every later query starts past it; the full group keeps it.
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, group_windows=(None, 4))
    a = make_request("a", list(range(6)))
    assert manager.num_blocks_for_prompt(6) == 4
    assert [ids(g) for g in ([b] for b in manager.allocate_slots(a, 6))] == [[1, 2], [3, 4]]
    a.num_computed_tokens = 6
    for token in (6, 7, 8):
        a.append_output_token_ids([token])
        manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    # 9 tokens computed: the next query (position 9) sees keys 6..9 -> block 0 is out.
    a.append_output_token_ids([9])
    appended = manager.allocate_slots(a, 1)
    assert [[b.block_id for b in g] for g in appended] == [[], []]
    assert manager.get_block_ids("a") == [[1, 2, 5], [0, 4, 6]]
    assert manager.block_pool.blocks[3].ref_cnt == 0  # back in the free queue
    assert manager.num_held_blocks("a") == 5


def test_window_group_prefix_hit_needs_only_the_window(make_request) -> None:
    # One window group of 4 keys (Mistral): a hit of k blocks needs only the blocks the
    # query at position 4k sees (keys 4k-3 .. 4k: block k-1).
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, group_windows=(4,))
    a = make_request("a", list(range(17)))
    admit(manager, a)
    manager.free(a)
    pool = manager.block_pool
    # Evict the first three blocks (positions 0..11): their K/V is gone.
    for block in pool.blocks[1:4]:
        pool._evict(block)
    b = make_request("b", list(range(17)) + [99])
    hits, num_computed_tokens = manager.get_computed_blocks(b)
    assert num_computed_tokens == 16 and [[x.block_id for x in g] for g in hits] == [
        [0, 0, 0, 4]]
    # A full-attention group would need all four.
    full = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    c = make_request("c", list(range(17)))
    admit(full, c)
    full.free(c)
    full.block_pool._evict(full.block_pool.blocks[1])
    assert full.get_computed_blocks(make_request("d", list(range(17)) + [99])) == ([[]], 0)


def test_groups_do_not_share_cached_blocks(make_request) -> None:
    # The same tokens hold different layers' K/V in each group: separate cache keys.
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, group_windows=(None, 8))
    a = make_request("a", list(range(9)))
    admit(manager, a)
    full, window = manager.req_to_blocks["a"]
    assert full[0].block_hash != window[0].block_hash
    assert full[0].block_hash == a.block_hashes[0]
    b = make_request("b", list(range(9)))
    hits, num_computed_tokens = manager.get_computed_blocks(b)
    assert num_computed_tokens == 8
    assert [[x.block_id for x in g] for g in hits] == [[full[0].block_id, full[1].block_id],
                                                       [window[0].block_id,
                                                        window[1].block_id]]


@pytest.mark.parametrize("hash_prompt_rows", [False, True])
def test_prompt_rows_keep_generated_blocks_apart(make_request, hash_prompt_rows) -> None:
    """With hash_prompt_rows (the model computes prompt rows on other kernels), a block
    holding generated tokens is not the same K/V as those tokens in another request's
    prompt: b, whose prompt is a's prompt and output, hits only a's all-prompt block;
    c, a's exact prompt and output again, hits them all. Without it b hits them all."""
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True,
                             hash_prompt_rows=hash_prompt_rows)
    a = make_request("a", list(range(6)))  # blocks [0..3] [4, 5 | 6, 7] [8 ..
    admit(manager, a)
    for token in (6, 7, 8, 9, 10):
        a.append_output_token_ids([token])
        assert manager.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    b = make_request("b", list(range(11)) + [99])
    hits, num_computed_tokens = manager.get_computed_blocks(b)
    assert num_computed_tokens == (4 if hash_prompt_rows else 8)
    c = make_request("c", list(range(6)))
    c.append_output_token_ids([6, 7, 8, 9])
    assert manager.get_computed_blocks(c)[1] == 8
