"""The scheduler's side of the prefix cache's host tier (core/kv_offload.py): which
blocks it saves to which slots, which it loads back, and which slots it recycles, with a
fake runner (only the bookkeeping matters here). The engine's end to end, the copies
included: tests/engine/test_kv_offloading.py."""

from __future__ import annotations

from pagedllm.core.kv_offload import HostKVStore
from pagedllm.lora_request import LoRARequest


def _run_all(sched, step) -> list[list[tuple[int, int]]]:
    """Each step's saves, until every request is done."""
    saves = []
    while sched.has_unfinished_requests():
        output, _ = step(sched)
        saves.append(output.kv_blocks_to_save)
    return saves


def test_every_full_block_is_saved_once_as_the_steps_complete_it(
        make_scheduler, make_request, step) -> None:
    sched = make_scheduler(num_blocks=30, max_num_batched_tokens=6)
    sched.kv_store = tier = HostKVStore(64, block_size=4)
    a = make_request("a", 14, max_tokens=8)
    sched.add_request(a)
    saves = _run_all(sched, step)
    # 6 tokens a step: tokens 0-5 complete block 0, 6-11 blocks 1 and 2; block 3 (12-15)
    # is full once its generated tokens are computed (14 + 8 - 1 = 21 tokens: 5 blocks,
    # the 5th a step after its 20th token is known).
    assert len(a.block_hashes) == 5
    flat = [pair for s in saves for pair in s]
    assert [slot for _, slot in flat] == [tier.slots[h] for h in a.block_hashes] \
        == [0, 1, 2, 3, 4]
    assert [len(s) for s in saves[:3]] == [1, 2, 0]
    # Saved from the request's own blocks, each when its last token was computed.
    assert tier.num_saved == 5 and len(set(b for b, _ in flat)) == 5


def test_a_prefix_the_cache_evicted_loads_from_the_tier(make_scheduler, make_request,
                                                       step) -> None:
    sched = make_scheduler(num_blocks=30)
    sched.kv_store = tier = HostKVStore(64, block_size=4)
    sched.add_request(make_request("a", 21, max_tokens=1))
    _run_all(sched, step)
    assert sched.kv_cache_manager.reset_prefix_cache()
    # The same prompt loads up to the block of its last token (21 tokens: blocks 0-4;
    # block 5 holds token 20); one that shares its first 9 tokens, admitted next, finds
    # the first two in the cache already (b's blocks, filled before the forward pass).
    sched.add_request(make_request("b", 21, max_tokens=1))
    sched.add_request(make_request("c", list(range(9)) + [99] * 12, max_tokens=1))
    hits = sched.kv_cache_manager.prefix_cache_hits
    output = sched.schedule()
    loads = output.kv_blocks_to_load
    assert [slot for slot, _ in loads] == [0, 1, 2, 3, 4]
    b_blocks = sched.kv_cache_manager.get_block_ids("b")[0]
    assert [block for _, block in loads] == b_blocks[:5]
    assert sched.requests["b"].num_computed_tokens == 20 + 1  # (this step's token)
    assert sched.kv_cache_manager.prefix_cache_hits - hits == 8
    assert tier.hits == 20 and tier.queries == 3 * 21  # (a, b and c looked up)
    # What they loaded is not saved again; c's own blocks after the shared ones are.
    assert {tuple(tier.slots[h] for h in sched.requests["c"].block_hashes[2:5])} \
        == {(5, 6, 7)}
    assert [slot for _, slot in output.kv_blocks_to_save] == [5, 6, 7]


def test_lookups_stop_at_the_first_missing_block(make_scheduler, make_request, step) -> None:
    sched = make_scheduler(num_blocks=30)
    sched.kv_store = tier = HostKVStore(64, block_size=4)
    sched.add_request(make_request("a", 21, max_tokens=1))
    _run_all(sched, step)
    # Forget block 2 of the tier: the lookup takes blocks 0 and 1 only.
    gone = next(h for h, slot in tier.slots.items() if slot == 2)
    del tier.slots[gone]
    tier.free.append(2)
    assert sched.kv_cache_manager.reset_prefix_cache()
    sched.add_request(make_request("b", 21, max_tokens=1))
    output = sched.schedule()
    assert [slot for slot, _ in output.kv_blocks_to_load] == [0, 1]
    # Block 2 is computed and saved again, into the freed slot; 3 and 4 are found there.
    assert [slot for _, slot in output.kv_blocks_to_save] == [2]


def test_a_full_tier_recycles_its_least_recently_used_slots(make_scheduler, make_request,
                                                            step) -> None:
    sched = make_scheduler(num_blocks=30)
    sched.kv_store = tier = HostKVStore(4, block_size=4)
    a = make_request("a", [1] * 9, max_tokens=1)   # blocks a0 a1 (+ the last token's)
    sched.add_request(a)
    _run_all(sched, step)
    b = make_request("b", [2] * 9, max_tokens=1)
    sched.add_request(b)
    _run_all(sched, step)
    assert list(tier.slots.values()) == [0, 1, 2, 3] and not tier.free
    # a's blocks found again (after the cache forgot them) become the most recent...
    assert sched.kv_cache_manager.reset_prefix_cache()
    sched.add_request(make_request("a2", [1] * 9, max_tokens=1))
    _run_all(sched, step)
    assert list(tier.slots.values()) == [2, 3, 0, 1]
    # ...so a new prompt takes b's slots.
    sched.add_request(make_request("c", [3] * 9, max_tokens=1))
    _run_all(sched, step)
    assert tier.num_evicted == 2
    assert not any(h in tier.slots for h in b.block_hashes)
    assert all(h in tier.slots for h in a.block_hashes[:2])


def test_one_step_never_saves_two_blocks_to_one_slot(make_scheduler, make_request,
                                                     step) -> None:
    sched = make_scheduler(num_blocks=30)
    sched.kv_store = tier = HostKVStore(3, block_size=4)
    sched.add_request(make_request("a", 30, max_tokens=1))  # 7 full blocks in one step
    output, _ = step(sched)
    slots = [slot for _, slot in output.kv_blocks_to_save]
    assert sorted(slots) == [0, 1, 2]
    assert len(tier.slots) == 3


def test_shared_blocks_are_saved_once_and_lora_blocks_are_kept_apart(
        make_scheduler, make_request, step) -> None:
    sched = make_scheduler(num_blocks=40)
    sched.kv_store = tier = HostKVStore(64, block_size=4)
    sched.add_request(make_request("a", 13, max_tokens=1))
    sched.add_request(make_request("b", 13, max_tokens=1))
    lora = make_request("c", 13, max_tokens=1)
    lora.lora_request = LoRARequest("x", 1, "/x")
    sched.add_request(lora)
    output, _ = step(sched)
    # a and b hash alike (one save each block); the adapter's blocks hash apart.
    assert len(output.kv_blocks_to_save) == 6 and len(tier.slots) == 6


def test_clear_forgets_every_block(make_scheduler, make_request, step) -> None:
    sched = make_scheduler(num_blocks=30)
    sched.kv_store = tier = HostKVStore(8, block_size=4)
    sched.add_request(make_request("a", 21, max_tokens=1))
    _run_all(sched, step)
    tier.clear()
    assert not tier.slots and len(tier.free) == 8 and not tier.next_block
    assert sched.kv_cache_manager.reset_prefix_cache()
    sched.add_request(make_request("b", 21, max_tokens=1))
    output = sched.schedule()
    assert output.kv_blocks_to_load == []
    assert [slot for _, slot in output.kv_blocks_to_save] == [0, 1, 2, 3, 4]
