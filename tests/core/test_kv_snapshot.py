"""The dashboard's block snapshot, to the exact block id, on a 10-block pool."""

from __future__ import annotations

from array import array

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_snapshot import CACHED, FIRST_REQ, FREE, NULL, SHARED, snapshot_blocks

BLOCK_SIZE = 4


def states(manager: KVCacheManager) -> tuple[list[int], list[str], list[int]]:
    snap = snapshot_blocks(manager)
    decoded = array("H")
    decoded.frombytes(snap.block_states)  # little-endian on every host CI runs
    return list(decoded), snap.req_ids, snap.num_held_blocks


def admit(manager: KVCacheManager, request) -> None:
    hits, num_computed = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_computed, hits,
                                  num_computed) is not None
    request.num_computed_tokens = request.num_tokens


def test_states_through_a_shared_prefix_and_frees(make_request) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    assert states(manager) == ([NULL] + [FREE] * 9, [], [])

    a = make_request("a", list(range(10)))  # blocks 1, 2 (full, cached), 3 (partial)
    admit(manager, a)
    A = FIRST_REQ
    assert states(manager) == ([NULL, A, A, A] + [FREE] * 6, ["a"], [3])

    # b shares a's two full blocks and gets block 4 of its own.
    b = make_request("b", list(range(8)) + [50, 51, 52])
    admit(manager, b)
    B = FIRST_REQ + 1
    assert states(manager) == ([NULL, SHARED, SHARED, A, B] + [FREE] * 5, ["a", "b"],
                               [3, 3])

    # a leaves: its full blocks stay held by b, its partial block 3 is free and empty.
    manager.free(a)
    B = FIRST_REQ  # b is request 0 of this snapshot
    assert states(manager) == ([NULL, B, B, FREE, B] + [FREE] * 5, ["b"], [3])

    # b leaves: its full blocks (1, 2) stay cached, block 4 (partial) is empty.
    manager.free(b)
    assert states(manager) == ([NULL, CACHED, CACHED] + [FREE] * 7, [], [])

    # A cached block handed out again is evicted: no longer shown as cached.
    c = make_request("c", [90 + i for i in range(36)])  # 9 blocks: the whole pool
    admit(manager, c)
    assert states(manager) == ([NULL] + [FIRST_REQ] * 9, ["c"], [9])


def test_window_group_null_entries_are_skipped(make_request) -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, group_windows=(4,))
    r = make_request("r", 12)  # 3 blocks; a window of 4 needs only the last one or two
    admit(manager, r)
    held = manager.num_held_blocks("r")
    got, req_ids, num_held = states(manager)
    assert req_ids == ["r"] and num_held == [held]
    assert got.count(FIRST_REQ) == held
    assert got[0] == NULL
