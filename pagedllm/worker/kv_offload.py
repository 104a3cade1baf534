"""The host tier of the prefix cache (core/kv_offload.py decides what moves): this
worker's copy of every KV cache tensor with one block per slot, and the step's copies
into and out of it.

The tier mirrors the device caches as swap preemption's host pool does
(worker/swap.py, whose copies it uses): pinned memory on CUDA, so the copies are
asynchronous transfers ordered by the stream; plain lazily mapped memory on CPU.
"""

from __future__ import annotations

import torch

from pagedllm.worker.swap import allocate_host_kv_cache, copy_blocks


class HostKVTier:
    """Loads before a step's forward pass, saves after it, as the directory store's
    KVTransfer (worker/kv_transfer.py) does, with host slots for file names."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.host_caches: list[torch.Tensor] = []

    def bind(self, caches: list[torch.Tensor]) -> None:
        """(Re)allocate the tier for these device caches (start-up, wake_up): empty, as
        the engine forgets what it held whenever the KV cache goes."""
        self.host_caches = allocate_host_kv_cache(caches, self.num_slots)

    def load(self, caches: list[torch.Tensor], loads: list[tuple[int, int]],
             ) -> dict[int, str]:
        """Copy slot -> block id for each pair; no failures to report."""
        slots, block_ids = zip(*loads)
        for cache, host in zip(caches, self.host_caches, strict=True):
            copy_blocks(host, cache, slots, block_ids)
        return {}

    def save(self, caches: list[torch.Tensor], saves: list[tuple[int, int]]) -> None:
        """Copy block id -> slot for each pair (the forward pass has written them)."""
        block_ids, slots = zip(*saves)
        for cache, host in zip(caches, self.host_caches, strict=True):
            copy_blocks(cache, host, block_ids, slots)
