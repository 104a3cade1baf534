"""KV cache sizing and allocation."""

from __future__ import annotations

import ctypes
import logging
import math
import mmap

import torch
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_groups import KVCacheLayout, max_blocks_per_request

logger = logging.getLogger(__name__)

GiB = 1 << 30
# Blocks per layer whose pages are populated at start-up (see allocate_kv_cache).
PREFAULT_BLOCKS = 2048
HUGE_PAGE = 2 << 20


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def cache_slots(model: nn.Module, layout: KVCacheLayout | None = None,
                first_layer: int = 0) -> dict[int, list[Attention]]:
    """This worker's attention layers by KV cache slot (core/kv_groups.py: the layers of
    one slot, one per group, share a K/V tensor). `first_layer`: the global index of
    the first local attention layer (pipeline parallelism). Without a layout every
    layer has its own slot."""
    slots: dict[int, list[Attention]] = {}
    for index, layer in enumerate(attention_layers(model), start=first_layer):
        slot = layout.layer_slot[index] if layout is not None else index
        slots.setdefault(slot, []).append(layer)
    for layers in slots.values():
        shapes = {(a.spec.num_kv_heads, a.spec.head_size) for a in layers}
        if len(shapes) > 1:
            raise ValueError(f"layers sharing a KV cache slot differ in K/V shape {shapes}: "
                             "sliding-window KV groups need equal head shapes")
    return slots


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype,
                       layout: KVCacheLayout | None = None, first_layer: int = 0) -> int:
    """K and V bytes of one block summed over every KV cache slot of this worker."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * layers[0].spec.num_kv_heads * layers[0].spec.head_size * elem
               for layers in cache_slots(model, layout, first_layer).values())


def determine_num_blocks(model: nn.Module, cache: CacheConfig, sched: SchedulerConfig,
                         dtype: torch.dtype, layout: KVCacheLayout | None = None,
                         first_layer: int = 0, extra_bytes_per_block: int = 0) -> int:
    """Blocks that fit kv_cache_space (or the num_kv_blocks override), block 0 included.

    Never more than every sequence at full length needs (a window group: its window's
    blocks): beyond that, memory (and the scheduler's per-block bookkeeping) would be
    spent on blocks nobody can use.
    """
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    # extra_bytes_per_block: a draft model's K/V in the same blocks (speculative decoding).
    per_block = (kv_bytes_per_block(model, cache.block_size, dtype, layout, first_layer)
                 + extra_bytes_per_block)
    if per_block == 0:
        # No paged attention layer (an encoder-only model): block ids are the
        # scheduler's bookkeeping only and cost no memory, so every useful one exists.
        return _num_useful_blocks(cache, sched, layout)
    fit = int(cache.kv_cache_space * GiB) // per_block
    num_blocks = min(fit, _num_useful_blocks(cache, sched, layout))
    if num_blocks < 2:
        raise ValueError(f"kv_cache_space={cache.kv_cache_space} GiB holds {fit} blocks of "
                         f"{per_block} bytes; at least 2 are needed")
    return num_blocks


def determine_num_swap_blocks(model: nn.Module, cache: CacheConfig, sched: SchedulerConfig,
                              dtype: torch.dtype, layout: KVCacheLayout | None = None,
                              first_layer: int = 0, extra_bytes_per_block: int = 0) -> int:
    """Host blocks of swap preemption that fit swap_space, block 0 included (unused, as
    on the device); 0 unless preemption_mode is "swap" or when fewer than 2 fit.

    Capped like the device pool at max_num_seqs full-length sequences: under fcfs the
    running and swapped requests together never exceed max_num_seqs (nothing is admitted
    while a swapped request waits), so more host blocks could never be used.
    """
    if sched.preemption_mode != "swap":
        return 0
    # extra_bytes_per_block: a draft model's K/V in the same blocks (speculative decoding).
    per_block = (kv_bytes_per_block(model, cache.block_size, dtype, layout, first_layer)
                 + extra_bytes_per_block)
    if per_block == 0:
        return 0  # no KV cache, nothing to swap
    fit = int(cache.swap_space * GiB) // per_block
    num_blocks = min(fit, _num_useful_blocks(cache, sched, layout))
    if num_blocks < 2:
        logger.warning("swap_space=%s GiB holds no KV block of %d bytes: every preemption "
                       "recomputes", cache.swap_space, per_block)
        return 0
    return num_blocks


def _num_useful_blocks(cache: CacheConfig, sched: SchedulerConfig,
                       layout: KVCacheLayout | None) -> int:
    """Blocks (null block included) beyond which none could ever be used: every
    sequence at full length (a window group holding its window's blocks), and at least
    one full-length prompt prefilled at once (every group holding every position)."""
    windows = layout.group_windows if layout is not None else (None,)
    blocks_per_seq = sum(max_blocks_per_request(w, sched.max_model_len, cache.block_size)
                         for w in windows)
    one_prompt = len(windows) * -(-sched.max_model_len // cache.block_size)
    return max(sched.max_num_seqs * blocks_per_seq, one_prompt) + 1


def allocate_kv_cache(model: nn.Module, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device,
                      layout: KVCacheLayout | None = None,
                      first_layer: int = 0) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, KVH, D] tensor per KV cache slot (per attention
    layer without KV cache groups), bound to its layers with their group."""
    for index, layer in enumerate(attention_layers(model)):
        layer.layer_index = index
        if layout is not None:
            layer.kv_group = layout.layer_group[first_layer + index]
    caches = []
    for layers in cache_slots(model, layout, first_layer).values():
        spec = layers[0].spec
        shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_size)
        # Zeroed: padded reads of unused slots must be finite (masked later).
        if device.type == "cpu":
            cache = lazy_zeros(shape, dtype)
            # Blocks are handed out in id order at first; populating the first ones now
            # keeps their page faults out of the first requests' latency (measured: +8 ms
            # time to first token for 128 new tokens on a fresh VM) at ~1/6 of the cost
            # of populating the whole cache up front.
            cache[:, :PREFAULT_BLOCKS].zero_()
        else:
            cache = torch.zeros(shape, dtype=dtype, device=device)
        for layer in layers:
            layer.kv_cache = cache
        caches.append(cache)
    return caches


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose memory is only touched when used, on huge pages where the
    kernel allows them.

    torch.zeros writes every byte up front: for a multi-GiB KV cache that was most of the
    start-up (5.8 s for 4.3 GiB on a fresh VM, against ~0.1 s here) and all of it counted
    in RSS. An anonymous mapping gives fresh zero pages instead, populated on first
    write. Huge pages (asked for with madvise; transparent_hugepage=madvise is a common
    default) save TLB misses on the scattered block reads of decode attention.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = elem * math.prod(shape)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -_address(buf) % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % HUGE_PAGE)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes,
                            offset=offset).view(dtype).view(shape)


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))
