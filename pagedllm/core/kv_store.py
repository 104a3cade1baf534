"""KV blocks shared with other engines through a directory: which blocks the scheduler
loads from it and which it has saved there (kv_transfer_config, config.KVTransferConfig).

Pure Python like the rest of core/: the files are read and written by the runners
(worker/kv_transfer.py), driven by the (file stem, block id) pairs of SchedulerOutput.

A block's file is named by its prefix-cache hash (core/block_hash.py), which covers its
tokens and every token before it, so a file holds exactly the K/V a prefill of that
prefix writes. Each tensor-parallel rank has its own file of its heads. Files appear
whole (written aside, then renamed), so a name that exists is a complete block; the
runner still checks what it reads (a file can vanish or be replaced by hand).

Only full blocks of the prompt are saved (the blocks a prefill completes), and only for
requests without a LoRA adapter (an adapter's id in the hash is one process's number).
The namespace folder keeps apart what is not interchangeable: another model, dtype, KV
dtype, block size or tensor-parallel layout (engine/kv_transfer.py names it).
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pagedllm.core.block_hash import BlockHash
from pagedllm.request import Request

if TYPE_CHECKING:
    from pagedllm.core.block_pool import KVCacheBlock
    from pagedllm.core.kv_cache_manager import KVCacheManager

# Free files the file system must keep for saving to go on (with min_free_bytes).
MIN_FREE_INODES = 10_000
# Hashes whose load failed, kept out of lookups (a file that cannot be read would be
# found again by every admission); the oldest are dropped past this many.
MAX_BAD_BLOCKS = 100_000

STORE_DIR = "pagedllm-kv"
"""The store's folder under the configured shared_storage_path."""


def store_root(storage_path: str) -> str:
    return os.path.join(storage_path, STORE_DIR)


def block_file(root: str, stem: str, rank: int) -> str:
    """The file of tensor-parallel rank `rank`'s part of the block named `stem`."""
    return os.path.join(root, f"{stem}.r{rank}.kv")


class KVStore:
    """The scheduler's view of the shared directory: lookups and the save plan.

    `load`: the engine consumes blocks (kv_consumer, kv_both); `save`: it produces them
    (kv_producer, kv_both). Lookups read the directory every time (another engine may
    have added a block since), one stat per block and rank, stopping at the first miss.
    """

    def __init__(self, root: str, namespace: str, num_ranks: int, block_size: int,
                 load: bool, save: bool, min_free_bytes: int = 0) -> None:
        self.root = root
        self.block_size = block_size
        self.namespace = namespace
        self.num_ranks = num_ranks
        self.load = load
        self.save = save
        self.min_free_bytes = min_free_bytes
        # Prompt tokens of the requests looked up, and of those found in the store
        # (vLLM's external_prefix_cache_queries / _hits).
        self.queries = 0
        self.hits = 0
        # Blocks the runners were asked to load / save since start-up, and loads that
        # failed.
        self.num_loaded = 0
        self.num_saved = 0
        self.num_load_failures = 0
        # Whether the last save plan found the disk too full.
        self.disk_full = False
        # Blocks whose load failed (insertion-ordered: the oldest go first).
        self.bad: dict[BlockHash, None] = {}

    def stem(self, block_hash: BlockHash) -> str:
        """A block's file name without the rank part, relative to the store's root."""
        h = block_hash.hex()
        return f"{self.namespace}/{h[:2]}/{h}"

    def has(self, block_hash: BlockHash) -> bool:
        """Whether every rank's file of the block is in the directory (and no load of
        it failed)."""
        if block_hash in self.bad:
            return False
        stem = self.stem(block_hash)
        return all(os.path.exists(block_file(self.root, stem, r))
                   for r in range(self.num_ranks))

    def lookup(self, request: Request, num_hit_tokens: int,
               block_hashes: Sequence[BlockHash]) -> list[BlockHash] | None:
        """The blocks after a waiting request's `num_hit_tokens` of prefix hits that
        the store holds, up to the first missing one, as hashes. Like a prefix hit, never
        the block of the prompt's last token (the step must compute it for its logits).
        None for a request with a LoRA adapter: not looked up (the module docstring)."""
        if request.lora_request is not None:
            return None
        start = num_hit_tokens // self.block_size
        stop = min((request.num_tokens - 1) // self.block_size, len(block_hashes))
        found = []
        for i in range(start, stop):
            if not self.has(block_hashes[i]):
                break
            found.append(block_hashes[i])
        return found

    def record_loads(self, request: Request, stored: Sequence[BlockHash],
                     blocks: Sequence[KVCacheBlock]) -> list[tuple[str, int]]:
        """An admitted request's loads: the stored blocks' files into its first new
        `blocks`, as (file stem, block id); counts the lookup in the stats."""
        self.queries += request.num_tokens
        self.hits += len(stored) * self.block_size
        self.num_loaded += len(stored)
        return [(self.stem(h), b.block_id) for h, b in zip(stored, blocks, strict=False)]

    def plan_saves(self, requests: Mapping[str, Request],
                   num_scheduled_tokens: Mapping[str, int],
                   kv: KVCacheManager) -> list[tuple[int, str]]:
        """The step's saves, as (block id, file stem): each prompt block its scheduled
        tokens complete that the store lacks (once per hash); none while the disk is
        short of room."""
        B = self.block_size
        candidates: dict[BlockHash, int] = {}
        for req_id, num_tokens in num_scheduled_tokens.items():
            request = requests[req_id]
            # num_computed_tokens: before this step's tokens (schedule() adds them last).
            first = request.num_computed_tokens // B
            end = min(request.num_computed_tokens + num_tokens, request.num_prompt_tokens) // B
            if end <= first or request.lora_request is not None:
                continue
            hashes = kv.block_hashes(request)
            blocks = kv.get_blocks(req_id)
            for i in range(first, min(end, len(hashes))):
                candidates.setdefault(hashes[i], blocks[i].block_id)
        if not candidates:
            return []
        self.disk_full = not self.has_room()
        if self.disk_full:
            return []
        saves = [(block_id, self.stem(h)) for h, block_id in candidates.items()
                 if not self.has(h)]
        self.num_saved += len(saves)
        return saves

    def forget(self, block_hashes: Sequence[BlockHash]) -> None:
        """Keep these blocks out of lookups from now on (their load failed)."""
        for h in block_hashes:
            self.bad[h] = None
        while len(self.bad) > MAX_BAD_BLOCKS:
            del self.bad[next(iter(self.bad))]

    def has_room(self) -> bool:
        """Whether the file system keeps min_free_bytes free, and MIN_FREE_INODES files
        (a file a block: small blocks run out of inodes first). Saving pauses otherwise:
        a stream of distinct prompts must not fill the disk."""
        if not self.min_free_bytes:
            return True
        try:
            st = os.statvfs(self.root)  # (created at start-up: engine/kv_transfer.py)
        except OSError:
            return False
        # f_files 0: the file system has no inode limit to report.
        inodes_ok = st.f_files == 0 or st.f_favail >= MIN_FREE_INODES
        return st.f_bavail * st.f_frsize >= self.min_free_bytes and inodes_ok

    def clear(self) -> None:
        """Delete this engine's blocks from the directory (its namespace folder; other
        models' folders stay). The folder is renamed first, so other engines see each
        block there or gone, never half of one; the renamed folder is deleted on a
        thread of its own (thousands of files must not hold up the engine's steps)."""
        folder = os.path.join(self.root, self.namespace)
        doomed = f"{folder}.deleting-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(folder, doomed)
        except FileNotFoundError:
            return  # nothing stored (or another replica cleared it first)
        threading.Thread(target=shutil.rmtree, args=(doomed, True), daemon=True,
                         name="kv-store-clear").start()

    def renew_namespace(self, salt: str) -> None:
        """Use another folder from now on (the engine's weights changed: blocks saved
        before are not this model's K/V any more)."""
        self.namespace = f"{self.namespace.split('-')[0]}-{salt}"
