"""KV memory with an fp8 cache: one byte per element, so the same kv_cache_space (and
swap_space) holds twice the blocks of bfloat16 and four times those of float32; the
cache and the host swap pool are allocated in fp8 and swaps move fp8 blocks intact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.attention.backend import AttentionSpec
from pagedllm.attention.layer import Attention
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.worker.memory import (GiB, allocate_kv_cache, determine_num_blocks,
                                    determine_num_swap_blocks, kv_bytes_per_block)
from pagedllm.worker.swap import allocate_host_kv_cache, swap_blocks

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _model(num_layers: int = 3) -> nn.Module:
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25)
    return nn.ModuleList(Attention(spec, "torch_ref") for _ in range(num_layers))


def _sched(preemption_mode: str = "recompute") -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=2048, max_model_len=4096,
                           preemption_mode=preemption_mode)


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_halves_the_bytes_per_block(fp8):
    model = _model()
    per_fp8 = kv_bytes_per_block(model, 16, fp8)
    assert per_fp8 == 3 * 2 * 16 * 2 * 16  # layers x K,V x tokens x KV heads x D x 1 byte
    assert kv_bytes_per_block(model, 16, torch.bfloat16) == 2 * per_fp8
    assert kv_bytes_per_block(model, 16, torch.float32) == 4 * per_fp8


@pytest.mark.parametrize("fp8", FP8)
def test_same_space_holds_twice_the_blocks(fp8):
    model = _model()
    # Room for exactly 1000 bfloat16 blocks (not capped: 1024 sequences of 256 blocks).
    space = 1000 * kv_bytes_per_block(model, 16, torch.bfloat16) / GiB
    cache = CacheConfig(block_size=16, kv_cache_space=space, swap_space=space,
                        cache_dtype="fp8_e4m3")
    bf16 = determine_num_blocks(model, cache, _sched(), torch.bfloat16)
    assert bf16 == 1000
    assert determine_num_blocks(model, cache, _sched(), fp8) == 2 * bf16
    assert determine_num_blocks(model, cache, _sched(), torch.float32) == bf16 // 2
    swap = _sched("swap")
    assert determine_num_swap_blocks(model, cache, swap, fp8) == 2 * bf16
    assert determine_num_swap_blocks(model, cache, swap, torch.bfloat16) == bf16


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_cache_and_host_pool_and_swaps(fp8):
    model = _model(2)
    caches = allocate_kv_cache(model, 6, 4, fp8, torch.device("cpu"))
    assert all(c.dtype == fp8 and c.shape == (2, 6, 4, 2, 16) for c in caches)
    assert all(not c.view(torch.uint8).any() for c in caches)
    assert all(layer.kv_cache is cache for layer, cache in zip(model, caches, strict=True))
    gen = torch.Generator().manual_seed(0)
    for c in caches:  # every byte pattern, NaN codes included, must survive the trip
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.shape, generator=gen))
    before = [c.clone() for c in caches]
    host = allocate_host_kv_cache(caches, 4)
    assert all(h.dtype == fp8 and h.shape == (2, 4, 4, 2, 16) for h in host)
    swap_blocks(caches, host, [(3, 1), (5, 2)], [])
    swap_blocks(caches, host, [], [(1, 5), (2, 1)])
    for c, old in zip(caches, before):
        assert torch.equal(c[:, 5].view(torch.uint8), old[:, 3].view(torch.uint8))
        assert torch.equal(c[:, 1].view(torch.uint8), old[:, 5].view(torch.uint8))
        assert torch.equal(c[:, [0, 2, 3, 4]].view(torch.uint8),
                           old[:, [0, 2, 3, 4]].view(torch.uint8))


def test_cache_dtype_is_validated_and_fp8_is_an_alias():
    assert CacheConfig(cache_dtype="fp8").cache_dtype == "fp8_e4m3"
    assert CacheConfig().cache_dtype == "auto"
    with pytest.raises(ValueError, match="fp8_e4m3.*fp8_e5m2"):
        CacheConfig(cache_dtype="int8")
