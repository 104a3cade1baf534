"""kv_cache_memory_bytes (vLLM's --kv-cache-memory-bytes): the KV cache's size per worker
in bytes, instead of kv_cache_space on a CPU and of the memory profile on CUDA; the
num_kv_blocks override still wins."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.attention.backend import AttentionSpec
from pagedllm.attention.layer import Attention
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.errors import ConfigError
from pagedllm.worker.memory import determine_num_blocks, kv_bytes_per_block

SCHED = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=2048, max_model_len=4096)


def _model() -> nn.Module:
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25)
    return nn.ModuleList(Attention(spec, "torch_ref") for _ in range(3))


def test_bytes_size_the_cache():
    model = _model()
    per_block = kv_bytes_per_block(model, 16, torch.bfloat16)
    cache = CacheConfig(block_size=16, kv_cache_space=1.0,
                        kv_cache_memory_bytes=300 * per_block + per_block - 1)
    assert determine_num_blocks(model, cache, SCHED, torch.bfloat16) == 300

    def profile() -> int:
        raise AssertionError("the memory profile is not run when the bytes are given")

    assert determine_num_blocks(model, cache, SCHED, torch.bfloat16, profile_run=profile) \
        == 300
    cache.num_kv_blocks = 7
    assert determine_num_blocks(model, cache, SCHED, torch.bfloat16) == 7
    with pytest.raises(ConfigError, match=f"kv_cache_memory_bytes={per_block} bytes hold 1 "
                                          f"blocks of {per_block} bytes"):
        determine_num_blocks(model, CacheConfig(kv_cache_memory_bytes=per_block), SCHED,
                             torch.bfloat16)
    for bad in (0, -5, 1.5, True, "1G"):
        with pytest.raises(ConfigError, match="kv_cache_memory_bytes must be a positive "
                                              "integer"):
            CacheConfig(kv_cache_memory_bytes=bad)


def test_the_engine_takes_it(tmp_path):
    from pagedllm import LLM
    from tests.utils import save_tiny_model, tiny_llama_config

    path = save_tiny_model(tmp_path, tiny_llama_config())
    # The tiny Llama: 2 layers x K, V x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
    per_block = 2 * 2 * 16 * 2 * 16 * 4
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True,
              kv_cache_memory_bytes=50 * per_block)
    assert llm.llm_engine.engine_core.num_blocks == 50
