"""The host tier of the prefix cache (core/kv_offload.py decides what moves): this
worker's part of every block in one host row per slot, and the step's copies into and
out of it.

A row holds the block's K then V slab of every KV cache tensor (the draft model's
included), as the directory store's files do (worker/kv_transfer.py's layout). So a
block moves between the device and a slot as one contiguous copy, not one per layer and
K/V: on CUDA the slabs of a step's blocks are gathered into (or scattered from) a device
buffer with one index op per cache tensor, and each block's row is one asynchronous
copy to or from pinned memory, ordered by the stream (a load of a slot always follows
its save on the same stream, and the buffers are freed to the stream's allocator).
On CPU the rows are plain, lazily mapped memory, and each slab moves straight between
the cache and the rows' columns (one index op each way; a step-wide buffer cost its
page faults: 4 ms against 27 ms for 62 of SmolLM2's blocks).
"""

from __future__ import annotations

import torch

from pagedllm.worker.kv_transfer import cache_slabs, slab_layout
from pagedllm.worker.memory import lazy_zeros


class HostKVTier:
    """Loads before a step's forward pass, saves after it, as the directory store's
    KVTransfer (worker/kv_transfer.py) does, with host slots for file names."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # [num_slots, words of a block]: the cache's bytes as the widest integers that
        # divide each slab's rows (CPU index ops move uint8 3-4x slower than int64).
        self.rows: torch.Tensor | None = None
        self.word = torch.uint8
        self.layout: list[tuple[int, int]] = []  # [start, end) of each slab, in words

    def bind(self, caches: list[torch.Tensor]) -> None:
        """(Re)allocate the tier for these device caches (start-up, wake_up): empty, as
        the engine forgets what it held whenever the KV cache goes."""
        self.word = word_dtype(caches)
        size = self.word.itemsize
        self.layout = [(start // size, end // size) for start, end in slab_layout(caches)]
        shape = (self.num_slots, self.layout[-1][1])
        if caches[0].device.type == "cuda":
            self.rows = torch.empty(shape, dtype=self.word, pin_memory=True)
        else:
            self.rows = lazy_zeros(shape, self.word)

    def release(self) -> None:
        self.rows = None

    def load(self, caches: list[torch.Tensor], loads: list[tuple[int, int]],
             ) -> dict[int, str]:
        """Copy slot -> block id for each pair; no failures to report."""
        slots, block_ids = zip(*loads)
        device, n = caches[0].device, len(loads)
        ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
        if self.rows.device == device:  # (CPU: each slab straight from the rows)
            index = torch.tensor(slots, dtype=torch.int64)
            slabs = (self.rows[:, start:end].index_select(0, index)
                     for start, end in self.layout)
        else:
            buf = torch.empty((n, self.rows.shape[1]), dtype=self.word, device=device)
            for i, slot in enumerate(slots):
                buf[i].copy_(self.rows[slot], non_blocking=True)
            slabs = (buf[:, start:end] for start, end in self.layout)
        for (cache, kv), slab in zip(cache_slabs(caches), slabs, strict=True):
            dst = cache[kv].view(self.word)
            dst.index_copy_(0, ids, slab.reshape(n, *dst.shape[1:]))
        return {}

    def save(self, caches: list[torch.Tensor], saves: list[tuple[int, int]]) -> None:
        """Copy block id -> slot for each pair (the forward pass has written them)."""
        block_ids, slots = zip(*saves)
        device, n = caches[0].device, len(saves)
        ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
        slabs = (cache[kv].view(self.word).index_select(0, ids).reshape(n, -1)
                 for cache, kv in cache_slabs(caches))
        if self.rows.device == device:  # (CPU: each slab straight into the rows)
            index = torch.tensor(slots, dtype=torch.int64)
            for slab, (start, end) in zip(slabs, self.layout, strict=True):
                self.rows[:, start:end].index_copy_(0, index, slab)
            return
        buf = torch.cat(list(slabs), dim=1)  # the blocks' rows, on the device
        for i, slot in enumerate(slots):
            self.rows[slot].copy_(buf[i], non_blocking=True)


def word_dtype(caches: list[torch.Tensor]) -> torch.dtype:
    """The widest integer type whose size divides the last dimension's bytes of every
    cache (each slab then views as whole words)."""
    row_bytes = [c.shape[-1] * c.element_size() for c in caches]
    return next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if all(b % w.itemsize == 0 for b in row_bytes))
