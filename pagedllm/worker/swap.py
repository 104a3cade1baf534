"""Host KV blocks of swap preemption, and the copies a step's swaps ask for.

The host cache mirrors the device cache, one `[2, num_swap_blocks, block_size,
num_kv_heads, head_size]` tensor per attention layer (0: K, 1: V). The scheduler decides
which blocks move (SchedulerOutput.blocks_to_swap_out / blocks_to_swap_in); this module
only copies, before the step's forward pass.
"""

from __future__ import annotations

import torch

from pagedllm.attention.kv_quant import raw_bytes
from pagedllm.worker.memory import lazy_zeros


def allocate_host_kv_cache(device_caches: list[torch.Tensor], num_swap_blocks: int,
                           ) -> list[torch.Tensor]:
    """One host tensor per device cache, with `num_swap_blocks` blocks ([] for 0).

    CPU: plain host memory, mapped lazily (only swapped blocks are ever touched). CUDA:
    pinned, so that the copies can be asynchronous DMA transfers.
    """
    if num_swap_blocks == 0:
        return []
    caches = []
    for cache in device_caches:
        shape = (cache.shape[0], num_swap_blocks, *cache.shape[2:])
        if cache.device.type == "cuda":
            caches.append(torch.empty(shape, dtype=cache.dtype, pin_memory=True))
        else:
            caches.append(lazy_zeros(shape, cache.dtype))
    return caches


def swap_blocks(device_caches: list[torch.Tensor], host_caches: list[torch.Tensor],
                blocks_to_swap_out: list[tuple[int, int]],
                blocks_to_swap_in: list[tuple[int, int]]) -> None:
    """Run a step's swaps: every swap-out (device -> host), then every swap-in.

    NOTE: the order matters. A device block freed by a swap-out may be the destination
    of a swap-in of the same step (or be written by its forward pass), so its contents
    must reach the host first. The scheduler decides all of a step's swap-outs before
    its first swap-in, so no host block is both freed and reused within one step.
    """
    if blocks_to_swap_out:
        device_ids, host_ids = zip(*blocks_to_swap_out)
        for device_cache, host_cache in zip(device_caches, host_caches, strict=True):
            copy_blocks(device_cache, host_cache, device_ids, host_ids)
    if blocks_to_swap_in:
        host_ids, device_ids = zip(*blocks_to_swap_in)
        for device_cache, host_cache in zip(device_caches, host_caches, strict=True):
            copy_blocks(host_cache, device_cache, host_ids, device_ids)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: tuple[int, ...],
                dst_ids: tuple[int, ...]) -> None:
    """dst[:, dst_ids[i]] = src[:, src_ids[i]] over the block dimension of two
    [2, num_blocks, block_size, KVH, D] caches."""
    if src.device == dst.device:
        gather_scatter_blocks(src, dst, src_ids, dst_ids)
    else:
        copy_blocks_async(src, dst, src_ids, dst_ids)


def gather_scatter_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: tuple[int, ...],
                          dst_ids: tuple[int, ...]) -> None:
    """Same-device copy (CPU: host to host): one gather and one scatter per layer. fp8
    caches move as bytes (torch has no CPU index_copy_ for fp8)."""
    src, dst = raw_bytes(src), raw_bytes(dst)
    index = torch.tensor(src_ids, dtype=torch.int64, device=src.device)
    gathered = src.index_select(1, index)  # [2, n, block_size, KVH, D]
    dst.index_copy_(1, torch.tensor(dst_ids, dtype=torch.int64, device=dst.device),
                    gathered)


def copy_blocks_async(src: torch.Tensor, dst: torch.Tensor, src_ids: tuple[int, ...],
                      dst_ids: tuple[int, ...]) -> None:
    """Device <-> pinned host copy: each K or V block is one contiguous [block_size, KVH,
    D] slab, copied asynchronously on the current stream.

    Stream order keeps it correct: a swap-out lands before the forward pass rewrites its
    device block, and before a later swap-in reads its host block (the host never reads
    these tensors itself).
    """
    for src_id, dst_id in zip(src_ids, dst_ids):
        for kv in range(src.shape[0]):
            dst[kv, dst_id].copy_(src[kv, src_id], non_blocking=True)
