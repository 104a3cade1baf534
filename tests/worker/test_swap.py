"""The runner's swap copies (worker/swap.py): block contents move by the scheduler's id
pairs, swap-outs before swap-ins."""

from __future__ import annotations

import torch

from pagedllm.worker.swap import (allocate_host_kv_cache, copy_blocks_async,
                                  gather_scatter_blocks, swap_blocks)

SHAPE = (2, 6, 4, 2, 8)  # [K/V, num_blocks, block_size, KVH, D]


def _caches(num_layers: int = 2) -> list[torch.Tensor]:
    return [torch.randn(SHAPE) for _ in range(num_layers)]


def test_host_cache_mirrors_device_cache():
    device = _caches()
    host = allocate_host_kv_cache(device, 3)
    assert [h.shape for h in host] == [(2, 3, 4, 2, 8)] * 2
    assert all(h.dtype == d.dtype and not h.is_pinned() for h, d in zip(host, device))
    assert allocate_host_kv_cache(device, 0) == []


def test_swap_out_then_in_in_one_step():
    device = _caches()
    before = [d.clone() for d in device]
    host = allocate_host_kv_cache(device, 4)
    swap_blocks(device, host, [(3, 1), (5, 2)], [])
    for d, h in zip(before, host):
        assert torch.equal(h[:, 1], d[:, 3]) and torch.equal(h[:, 2], d[:, 5])
    # One step: block 3 goes out to host block 3 while host block 1 (the old block 3)
    # comes back into block 3 and host block 2 into block 1; the swap-out reads block 3
    # before the swap-in overwrites it.
    swap_blocks(device, host, [(3, 3)], [(1, 3), (2, 1)])
    for d, h, old in zip(device, host, before):
        assert torch.equal(h[:, 3], old[:, 3])
        assert torch.equal(d[:, 3], old[:, 3]) and torch.equal(d[:, 1], old[:, 5])
        assert torch.equal(d[:, [0, 2, 4, 5]], old[:, [0, 2, 4, 5]])


def test_async_path_matches_gather_scatter_path():
    # The cross-device path (one copy per K/V slab) gives what the CPU gather does.
    src, dst_a = torch.randn(SHAPE), torch.zeros(SHAPE)
    dst_b = dst_a.clone()
    gather_scatter_blocks(src, dst_a, (4, 1, 2), (0, 5, 3))
    copy_blocks_async(src, dst_b, (4, 1, 2), (0, 5, 3))
    assert torch.equal(dst_a, dst_b)
    assert torch.equal(dst_a[:, 5], src[:, 1]) and not dst_a[:, [1, 2, 4]].any()
