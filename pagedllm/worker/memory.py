"""KV cache sizing and allocation."""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.errors import ConfigError
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
                         first_layer: int = 0, extra_bytes_per_block: int = 0,
                         profile_run: Callable[[], int] | None = None) -> int:
    """Blocks that fit the memory budget, block 0 included: the num_kv_blocks override,
    else kv_cache_memory_bytes, else (with `profile_run`, on CUDA) what
    gpu_memory_utilization leaves after the weights and a profiled forward pass
    (`cuda_num_blocks`), else kv_cache_space.

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
    if cache.kv_cache_memory_bytes is not None:
        budget, what = cache.kv_cache_memory_bytes, "kv_cache_memory_bytes="
    elif profile_run is not None:
        return cuda_num_blocks(cache, per_block, _num_useful_blocks(cache, sched, layout),
                               profile_run)
    else:
        budget = int(cache.kv_cache_space * GiB)
        what = f"kv_cache_space={cache.kv_cache_space} GiB = "
    fit = budget // per_block
    num_blocks = min(fit, _num_useful_blocks(cache, sched, layout))
    if num_blocks < 2:
        raise ConfigError(f"{what}{budget} bytes hold {fit} blocks of {per_block} bytes; "
                          f"at least 2 are needed")
    return num_blocks


def blocks_from_profile(total_bytes: int, utilization: float, weights_bytes: int,
                        peak_activation_bytes: int, non_torch_bytes: int,
                        bytes_per_block: int, cap_blocks: int) -> int:
    """KV blocks (block 0 included) in what `utilization` of the device's memory leaves
    after the weights, the activation peak of a full step and the memory torch does not
    manage (the CUDA context, other processes), at most `cap_blocks`.

    Pure arithmetic over a profile's figures (see `cuda_num_blocks`), so it is tested
    on any machine.
    """
    budget = int(total_bytes * utilization)
    kv_bytes = budget - weights_bytes - peak_activation_bytes - non_torch_bytes
    fit = max(kv_bytes, 0) // bytes_per_block
    if fit < 2:  # block 0 is the null block: one usable block at least
        raise ConfigError(
            f"no memory left for the KV cache: gpu_memory_utilization={utilization} x "
            f"{_gib(total_bytes)} GiB total is {_gib(budget)} GiB, of which the weights "
            f"take {_gib(weights_bytes)} GiB, the activation peak of a step "
            f"{_gib(peak_activation_bytes)} GiB and other processes / non-torch memory "
            f"(CUDA context) {_gib(non_torch_bytes)} GiB, leaving {_gib(kv_bytes)} GiB "
            f"for KV blocks of {bytes_per_block} bytes (2 at least). Raise "
            f"gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, or "
            f"use a smaller model")
    return min(fit, cap_blocks)


def cuda_num_blocks(cache: CacheConfig, bytes_per_block: int, cap_blocks: int,
                    profile_run: Callable[[], int]) -> int:
    """KV blocks sized by profiling the current CUDA device (vLLM's scheme; the caller
    makes the runner's device current).

    `profile_run()` runs the largest step the scheduler may send (over a temporary KV
    cache of its own) and returns its activation peak: the bytes allocated at the peak
    beyond what was allocated before it (`peak_allocated_bytes`). What torch holds
    before the profile counts as weights (the weights and persistent buffers; reserved
    rather than allocated bytes, so the allocator's rounding of their segments is in the
    budget too). What torch does not manage, the CUDA context and other processes'
    memory, is measured after the profile as used - torch's reserved bytes, and counts
    against the budget as well: the engine keeps the whole device within utilization x
    total, as long as nothing else grows later. (vLLM counts only what other processes
    allocate after its start, making the fraction per instance; this is simpler and
    stricter.)
    """
    gc.collect()
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_reserved()
    peak = profile_run()
    gc.collect()
    torch.cuda.empty_cache()  # the profile's cached blocks are not the engine's to keep
    free, total = torch.cuda.mem_get_info()
    non_torch = (total - free) - torch.cuda.memory_reserved()
    num_blocks = blocks_from_profile(total, cache.gpu_memory_utilization, weights, peak,
                                     non_torch, bytes_per_block, cap_blocks)
    logger.info("CUDA memory: %s GiB total x gpu_memory_utilization %s = %s GiB; "
                "weights %s GiB, activation peak %s GiB, non-torch %s GiB -> KV "
                "cache %s GiB, %d blocks", _gib(total), cache.gpu_memory_utilization,
                _gib(int(total * cache.gpu_memory_utilization)), _gib(weights), _gib(peak),
                _gib(non_torch), _gib(num_blocks * bytes_per_block), num_blocks)
    return num_blocks


def peak_allocated_bytes(run: Callable[[], object], device: torch.device) -> int:
    """Bytes torch's CUDA allocator held at the peak of `run()` beyond what it held
    before (the activations of a step, not what existed already). Off CUDA `run()` only
    runs and 0 comes back: there are no allocator statistics to read."""
    if device.type != "cuda":
        run()
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


@dataclass
class ProfileBatch:
    """Host arrays of the dummy step profiled on CUDA: prompt chunks of `seq_lens`
    tokens, nothing cached, over blocks 1.. of a temporary cache of `num_blocks`."""

    query_start_loc: np.ndarray  # [num_seqs + 1] int64
    seq_lens: np.ndarray  # [num_seqs] int64
    block_table: np.ndarray  # [num_seqs, blocks_per_seq] int32
    slot_mapping: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    num_blocks: int


def profile_batch(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                  block_size: int) -> ProfileBatch:
    """The largest step the scheduler can send: max_num_batched_tokens prompt tokens
    split as evenly as possible over min(max_num_seqs, tokens) sequences, none longer
    than max_model_len (so fewer tokens when they cannot hold the budget)."""
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    num_tokens = min(max_num_batched_tokens, num_seqs * max_model_len)
    seq_lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
    seq_lens[:num_tokens % num_seqs] += 1
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(seq_lens, out=query_start_loc[1:])
    # Sequence i owns blocks 1 + i * blocks_per_seq .. (block 0 is the null block).
    blocks_per_seq = -(-int(seq_lens[0]) // block_size)  # seq_lens[0] is the longest
    block_table = (1 + np.arange(num_seqs * blocks_per_seq, dtype=np.int32)
                   ).reshape(num_seqs, blocks_per_seq)
    # Token t belongs to sequence seq_of[t], at position t - query_start_loc[seq_of[t]].
    seq_of = np.repeat(np.arange(num_seqs), seq_lens)
    positions = np.arange(num_tokens) - query_start_loc[seq_of]
    slot_mapping = (block_table[seq_of, positions // block_size].astype(np.int64)
                    * block_size + positions % block_size)
    return ProfileBatch(query_start_loc, seq_lens, block_table, slot_mapping, positions,
                        num_blocks=1 + num_seqs * blocks_per_seq)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f}"


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
    slots = cache_slots(model, layout, first_layer)
    if device.type == "cpu":
        _check_host_memory(num_blocks, kv_bytes_per_block(model, block_size, dtype, layout,
                                                          first_layer))
    for layers in slots.values():
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


def unbind_kv_cache(model: nn.Module) -> None:
    """Drop every reference `model` holds to its KV cache (sleep mode frees it): the
    attention layers', and what modules built on them (the native layer stack), which
    modules with such state clear in their own `unbind_kv_cache()`."""
    for layer in attention_layers(model):
        layer.kv_cache = None
    for module in model.modules():
        unbind = getattr(module, "unbind_kv_cache", None)
        if callable(unbind):
            unbind()


def _check_host_memory(num_blocks: int, bytes_per_block: int) -> None:
    """Refuse a CPU KV cache larger than the machine's memory. Its pages are mapped
    lazily (`lazy_zeros`), so one that is merely too large would start and be killed
    when requests filled it; one past what the kernel maps failed with a bare
    OSError(ENOMEM) and a traceback."""
    import psutil

    need = num_blocks * bytes_per_block
    total = psutil.virtual_memory().total
    if need > total:
        raise ConfigError(
            f"a KV cache of {num_blocks} blocks ({_gib(need)} GiB) is larger than this "
            f"machine's memory ({_gib(total)} GiB): lower num_kv_blocks or kv_cache_space "
            f"(--num-kv-blocks, --kv-cache-space)")


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
