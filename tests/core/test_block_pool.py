"""BlockPool, FreeBlockQueue and block hashes, asserted to the exact block id."""

from __future__ import annotations

import pytest

from pagedllm.core.block_hash import hash_block_tokens, update_block_hashes
from pagedllm.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# ------------------------------------------------------------------ block hashes

def test_hash_is_stable_and_chained() -> None:
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h0, bytes) and len(h0) == 32
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4])  # equal prefixes collide on purpose
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    # Same tokens under a different parent: a different block.
    assert h1 != hash_block_tokens(hash_block_tokens(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert h1 != hash_block_tokens(None, [5, 6, 7, 8])


def test_hash_extra_keys_and_lengths_are_distinguished() -> None:
    base = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2], ("lora", 1)) != base
    assert hash_block_tokens(None, [1, 2], ("lora", 1)) != hash_block_tokens(None, [1, 2],
                                                                             ("lora", 2))
    assert hash_block_tokens(None, [1, 2], ("lora", 1)) == hash_block_tokens(None, [1, 2],
                                                                             ("lora", 1))
    assert hash_block_tokens(None, [1]) != hash_block_tokens(None, [1, 0])


def test_update_block_hashes_covers_only_full_blocks(make_request) -> None:
    request = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    hashes = update_block_hashes(request, block_size=4)
    assert hashes is request.block_hashes
    assert hashes == [hash_block_tokens(None, [1, 2, 3, 4])]
    request.append_output_token_ids([8, 9])
    update_block_hashes(request, block_size=4)
    assert request.block_hashes == [hashes[0], hash_block_tokens(hashes[0], [5, 6, 7, 8])]


# ------------------------------------------------------------------ free queue

def test_free_queue_popleft_append_and_remove_from_middle() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 5
    queue.remove(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 3, 4]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.append_n([blocks[0]])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4, 2, 0]
    assert [b.block_id for b in queue.popleft_n(5)] == [1, 3, 4, 2, 0]
    assert len(queue) == 0
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft_n(1)


def test_free_queue_remove_last_and_first() -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1]
    queue.remove(blocks[1])
    assert queue.get_all_free_blocks() == [] and len(queue) == 0


# ------------------------------------------------------------------ block pool

def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(num_blocks=10, enable_caching=True)
    assert free_ids(pool) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert pool.get_num_free_blocks() == 9
    blocks = pool.get_new_blocks(9)
    assert ids(blocks) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [9, 8, 7, 6, 5, 4, 3, 2, 1]
    assert pool.null_block.ref_cnt == 0 and 0 not in free_ids(pool)


def test_free_order_is_eviction_order() -> None:
    pool = BlockPool(num_blocks=10, enable_caching=True)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    b = pool.get_new_blocks(2)  # 4, 5
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    # Untouched blocks first, then a's tail-first, then b's (freed later).
    assert free_ids(pool) == [6, 7, 8, 9, 3, 2, 1, 5, 4]
    assert ids(pool.get_new_blocks(5)) == [6, 7, 8, 9, 3]


def test_cache_full_blocks_and_eviction_on_reuse() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    pool.cache_full_blocks(blocks, [h0, h1], num_cached_blocks=0, num_full_blocks=2)
    assert pool.get_cached_block(h0) is blocks[0] and blocks[0].block_hash == h0
    assert pool.get_cached_block(h1) is blocks[1]
    assert blocks[2].block_hash is None
    pool.free_blocks(reversed(blocks))  # queue: 3, 2, 1
    # Free but still cached until popped.
    assert pool.get_cached_block(h0) is blocks[0]
    popped = pool.get_new_blocks(2)
    assert ids(popped) == [3, 2]
    assert pool.get_cached_block(h1) is None and blocks[1].block_hash is None
    assert pool.get_cached_block(h0) is blocks[0]
    assert set(pool.cached_block_hash_to_block) == {h0}


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    h0 = hash_block_tokens(None, [7, 7])
    pool.cache_full_blocks(first, [h0], 0, 1)
    pool.cache_full_blocks(second, [h0], 0, 1)
    assert pool.get_cached_block(h0) is first[0]
    assert second[0].block_hash is None


def test_touch_removes_cached_free_block_from_queue() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    blocks = pool.get_new_blocks(2)  # 1, 2
    h0 = hash_block_tokens(None, [1])
    pool.cache_full_blocks(blocks, [h0], 0, 1)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 2, 1]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1
    assert free_ids(pool) == [3, 4, 2]
    pool.touch([blocks[0]])  # a second holder: ref_cnt only
    assert blocks[0].ref_cnt == 2 and free_ids(pool) == [3, 4, 2]
    pool.free_blocks([blocks[0]])
    assert blocks[0].ref_cnt == 1 and free_ids(pool) == [3, 4, 2]
    pool.free_blocks([blocks[0]])
    assert free_ids(pool) == [3, 4, 2, 1]
    assert pool.get_cached_block(h0) is blocks[0]


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [hash_block_tokens(None, [1])], 0, 1)
    assert blocks[0].block_hash is None and not pool.cached_block_hash_to_block


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    h0 = hash_block_tokens(None, [1])
    pool.cache_full_blocks(blocks, [h0], 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h0) is None and blocks[0].block_hash is None
    assert pool.get_num_free_blocks() == 3
