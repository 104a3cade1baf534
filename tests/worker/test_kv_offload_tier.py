"""The host tier's copies (worker/kv_offload.py): a block saved to a slot and loaded
into another block comes back bit for bit, for every cache dtype (fp8 as bytes) and
row widths that are not whole 8-byte words; slots keep apart. The engine end to end:
tests/engine/test_kv_offloading.py."""

from __future__ import annotations

import pytest
import torch

from pagedllm.worker.kv_offload import HostKVTier, word_dtype


def _caches(dtype: torch.dtype, head_size: int, num_layers: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 12, 4, 2, head_size, generator=g).to(dtype)
            for _ in range(num_layers)]


@pytest.mark.parametrize("dtype, head_size, word", [
    (torch.bfloat16, 64, torch.int64), (torch.float32, 3, torch.int32),
    (torch.float16, 5, torch.int16), (torch.float8_e4m3fn, 7, torch.uint8),
])
def test_blocks_come_back_bit_for_bit(dtype, head_size, word):
    caches = _caches(dtype, head_size)
    assert word_dtype(caches) == word
    tier = HostKVTier(num_slots=6)
    tier.bind(caches)
    before = [c.clone() for c in caches]
    tier.save(caches, [(3, 5), (7, 0), (1, 2)])
    # Loaded into other blocks: 9 <- 3's slot, 10 <- 7's, 11 <- 1's.
    tier.load(caches, [(5, 9), (0, 10), (2, 11)])
    for cache, old in zip(caches, before):
        for src, dst in ((3, 9), (7, 10), (1, 11)):
            assert torch.equal(cache[:, dst].view(torch.uint8), old[:, src].view(torch.uint8))
        # Nothing else moved.
        assert torch.equal(cache[:, :9].view(torch.uint8), old[:, :9].view(torch.uint8))


def test_a_slot_saved_again_holds_the_new_block():
    caches = _caches(torch.bfloat16, 64)
    tier = HostKVTier(num_slots=2)
    tier.bind(caches)
    tier.save(caches, [(3, 1)])
    tier.save(caches, [(4, 1)])
    tier.load(caches, [(1, 8)])
    assert all(torch.equal(c[:, 8], c[:, 4]) for c in caches)
    tier.release()
    assert tier.rows is None
