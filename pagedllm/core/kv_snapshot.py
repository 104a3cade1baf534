"""A compact picture of the KV block pool, for the dashboard (`/dashboard`).

The engine core builds one only when asked (a utility call, at most a few times a second
while a dashboard is open), never from the step loop. One uint16 per block:

    0  FREE     free and empty
    1  CACHED   free, still holding a prefix-cache hash (evictable, a future hit)
    2  NULL     block 0, never handed out
    3  SHARED   in use by more than one request (a shared prefix)
    4+k         in use by request k alone (k indexes `KVSnapshot.req_ids`)

Cost: one pass over the cached blocks and one over the blocks requests hold, so
O(cached + held), not a scan of the whole pool; free empty blocks cost nothing.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass

from pagedllm.core.kv_cache_manager import KVCacheManager

FREE, CACHED, NULL, SHARED, FIRST_REQ = 0, 1, 2, 3, 4
# uint16: request slots 4..65535.
MAX_REQS = 0xFFFF - FIRST_REQ


@dataclass
class KVSnapshot:
    block_states: bytes
    """uint16 little-endian per block id (states above)."""
    req_ids: list[str]
    """Request k of state 4 + k: every request holding at least one block."""
    num_held_blocks: list[int]
    """Blocks each request of `req_ids` holds (shared ones included)."""


def snapshot_blocks(kv: KVCacheManager) -> KVSnapshot:
    """The state of every block of `kv`'s pool now (see the module docstring)."""
    pool = kv.block_pool
    states = array("H", bytes(2 * pool.num_blocks))
    states[0] = NULL
    for block in pool.cached_block_hash_to_block.values():
        if block.ref_cnt == 0:
            states[block.block_id] = CACHED
    req_ids: list[str] = []
    num_held: list[int] = []
    for req_id, groups in kv.req_to_blocks.items():
        # Past MAX_REQS requests the rest show as shared (a pool that big is rare).
        mark = FIRST_REQ + len(req_ids) if len(req_ids) < MAX_REQS else SHARED
        count = 0
        for blocks in groups:
            for block in blocks:
                # ref_cnt 0: the null block (a window group's block given back).
                if block.ref_cnt == 1:
                    states[block.block_id] = mark
                elif block.ref_cnt:
                    states[block.block_id] = SHARED
                else:
                    continue
                count += 1
        if count:
            req_ids.append(req_id)
            num_held.append(count)
    if sys.byteorder == "big":
        states.byteswap()  # big-endian host: the wire format is little-endian
    return KVSnapshot(states.tobytes(), req_ids, num_held)


def concat_snapshots(snapshots: list[KVSnapshot]) -> KVSnapshot:
    """Several pools' snapshots (data parallel replicas) as one, laid end to end: each
    pool's blocks after the previous pool's, its request marks renumbered after theirs."""
    if len(snapshots) == 1:
        return snapshots[0]
    out = array("H")
    req_ids: list[str] = []
    num_held: list[int] = []
    for snap in snapshots:
        states = array("H")
        states.frombytes(snap.block_states)
        if sys.byteorder == "big":
            states.byteswap()
        offset = len(req_ids)
        if offset:
            for i, state in enumerate(states):
                if state >= FIRST_REQ:
                    # Past MAX_REQS requests the rest show as shared, as in one pool.
                    states[i] = state + offset if state + offset <= 0xFFFF else SHARED
        out.extend(states)
        req_ids.extend(snap.req_ids)
        num_held.extend(snap.num_held_blocks)
    if sys.byteorder == "big":
        out.byteswap()
    return KVSnapshot(out.tobytes(), req_ids, num_held)
