"""Reading and writing KV blocks of the shared directory (core/kv_store.py decides
which): one file per block and tensor-parallel rank, this worker's part of every
attention layer's K and V for the block's positions.

File layout (little-endian): a 56-byte header, then the payload.

    magic "PGLKV\\0\\1\\0" | block hash (32 bytes) | rank (u32) | slabs (u32) |
    payload bytes (u64) | K then V of each KV cache tensor, the block's
    [block_size, num_kv_heads, head_size] slab as stored (fp8 caches: their bytes)

A load checks all of it against what this worker's cache needs, so a file from another
layout, a truncated one or one renamed by hand is refused (the block is zeroed and
reported), never read into the cache. Writes go to a temporary name and are renamed, so
other engines never see half a file.
"""

from __future__ import annotations

import logging
import os
import struct

import torch

from pagedllm.core.kv_store import block_file, store_root
from pagedllm.distributed.comm import all_reduce
from pagedllm.distributed.parallel_state import ParallelState

logger = logging.getLogger(__name__)

MAGIC = b"PGLKV\x00\x01\x00"
HEADER = struct.Struct("<8s32sIIQ")


class KVTransfer:
    """This worker's side of the KV store: loads before a step's forward pass, saves
    after it."""

    def __init__(self, storage_path: str, parallel: ParallelState) -> None:
        self.root = store_root(storage_path)
        self.parallel = parallel
        self.rank = parallel.tp_rank

    def load(self, caches: list[torch.Tensor], loads: list[tuple[str, int]],
             ) -> dict[int, str]:
        """Fill block `block_id` of every cache from file `stem`, for each pair; returns
        block id -> why for the blocks that could not be loaded on any rank of the
        tensor-parallel group (those are zeroed here)."""
        layout = slab_layout(caches)
        payload_bytes = layout[-1][1] if layout else 0
        # The files' payloads side by side, one row a block: then each slab of every
        # block goes in with one copy per cache tensor (not one per block).
        rows = torch.empty((len(loads), HEADER.size + payload_bytes), dtype=torch.uint8)
        failures: dict[int, str] = {}
        for i, (stem, block_id) in enumerate(loads):
            path = block_file(self.root, stem, self.rank)
            try:
                read_block(path, bytes.fromhex(os.path.basename(stem)), self.rank,
                           len(layout), payload_bytes, rows[i].numpy())
            except (OSError, ValueError) as e:
                failures[block_id] = f"{path}: {e}"
                logger.warning("KV store: cannot load %s", failures[block_id])
                rows[i].zero_()
        ids = torch.tensor([block_id for _, block_id in loads], dtype=torch.int64,
                           device=caches[0].device)
        for (cache, kv), (start, end) in zip(cache_slabs(caches), layout, strict=True):
            dst = cache[kv].view(torch.uint8)
            src = rows[:, HEADER.size + start:HEADER.size + end].to(dst.device)
            dst.index_copy_(0, ids, src.reshape(len(loads), *dst.shape[1:]))
        if self.parallel.tp_size > 1:
            # A rank's failure fails the block everywhere: every rank reads the same
            # list, so the flags line up.
            flags = torch.tensor([int(block_id in failures) for _, block_id in loads],
                                 dtype=torch.int32, device=caches[0].device)
            all_reduce(flags, self.parallel)
            for (stem, block_id), flag in zip(loads, flags.tolist(), strict=True):
                if flag and block_id not in failures:
                    failures[block_id] = (f"{stem}: the file of another tensor parallel "
                                          f"rank could not be loaded")
        return failures

    def save(self, caches: list[torch.Tensor], saves: list[tuple[int, str]]) -> None:
        """Write block `block_id` of every cache to file `stem`, for each pair (a file
        another engine wrote meanwhile is kept). A failed write is logged and dropped:
        the block stays computed here, only others miss it."""
        saves = [(block_id, stem) for block_id, stem in saves
                 if not os.path.exists(block_file(self.root, stem, self.rank))]
        if not saves:
            return
        layout = slab_layout(caches)
        ids = torch.tensor([block_id for block_id, _ in saves], dtype=torch.int64,
                           device=caches[0].device)
        # One row a file: header, then each slab gathered for all blocks at once.
        rows = torch.empty((len(saves), HEADER.size + layout[-1][1]), dtype=torch.uint8)
        for (cache, kv), (start, end) in zip(cache_slabs(caches), layout, strict=True):
            rows[:, HEADER.size + start:HEADER.size + end] = (
                cache[kv].view(torch.uint8).index_select(0, ids).reshape(len(saves), -1)
                .cpu())
        for row, (_, stem) in zip(rows.numpy(), saves, strict=True):
            HEADER.pack_into(row, 0, MAGIC, bytes.fromhex(os.path.basename(stem)),
                             self.rank, len(layout), layout[-1][1])
            path = block_file(self.root, stem, self.rank)
            tmp = f"{path}.{os.getpid()}.tmp"
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(row)
                os.replace(tmp, path)
            except OSError as e:
                logger.warning("KV store: cannot save %s: %s", path, e)
                try:
                    os.unlink(tmp)
                except OSError:
                    pass


def cache_slabs(caches: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """(cache, 0 for K / 1 for V) of every [2, num_blocks, block_size, KVH, D] cache,
    in file order."""
    return [(cache, kv) for cache in caches for kv in range(cache.shape[0])]


def slab_layout(caches: list[torch.Tensor]) -> list[tuple[int, int]]:
    """[start, end) of each slab of `cache_slabs` in a file's payload (bytes)."""
    layout, offset = [], 0
    for cache, kv in cache_slabs(caches):
        size = cache[kv, 0].numel() * cache.element_size()
        layout.append((offset, offset + size))
        offset += size
    return layout


def read_block(path: str, block_hash: bytes, rank: int, num_slabs: int,
               payload_bytes: int, out) -> None:
    """Read the file, header included, into `out` (a writable buffer of exactly its
    size); ValueError when it is not block `block_hash`'s part for `rank` in this
    layout."""
    size = HEADER.size + payload_bytes
    with open(path, "rb") as f:
        n = f.readinto(out)
        if n == size and f.read(1):
            n += 1  # longer than a block: refused too
    if n != size:
        raise ValueError(f"{n if n <= size else 'more than ' + str(size)} bytes, "
                         f"expected {size}")
    magic, h, file_rank, slabs, length = HEADER.unpack_from(out)
    if magic != MAGIC:
        raise ValueError("not a pagedllm KV block file")
    if (h, file_rank, slabs, length) != (block_hash, rank, num_slabs, payload_bytes):
        raise ValueError(f"the header names block {h.hex()[:16]}.. rank {file_rank}, "
                         f"{slabs} slabs of {length} bytes; expected block "
                         f"{block_hash.hex()[:16]}.. rank {rank}, {num_slabs} slabs of "
                         f"{payload_bytes} bytes")
