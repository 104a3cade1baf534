"""The `cpu` attention backend against the `torch_ref` oracle on hand-built batches that
mix prefill chunks (with and without cached context) and decodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.backend import AttentionSpec
from pagedllm.attention.cpu import CpuAttention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import TorchRefAttention


def make_metadata(num_computed: list[int], query_lens: list[int], block_size: int,
                  num_blocks: int, seed: int = 0) -> AttentionMetadata:
    """Requests with `num_computed` cached tokens each scheduling `query_lens` new ones;
    blocks are handed out at random (never block 0) so reads must follow the table."""
    rng = np.random.default_rng(seed)
    seq_lens = np.array(num_computed) + np.array(query_lens)
    blocks_per_req = -(-seq_lens // block_size)
    max_blocks = int(blocks_per_req.max()) + 1  # +1: a padded column of null blocks
    free = rng.permutation(np.arange(1, num_blocks))
    assert blocks_per_req.sum() <= len(free), "test cache too small"
    block_table = np.zeros((len(seq_lens), max_blocks), dtype=np.int32)
    start = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = free[start:start + n]
        start += n
    query_start_loc = np.zeros(len(seq_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    # slot of position p = block_table[p // block_size] * block_size + p % block_size
    slots = []
    for i, (c, q) in enumerate(zip(num_computed, query_lens)):
        pos = np.arange(c, c + q)
        slots.append(block_table[i, pos // block_size].astype(np.int64) * block_size
                     + pos % block_size)
    slot_mapping = np.concatenate(slots)
    return AttentionMetadata(
        num_reqs=len(seq_lens), num_actual_tokens=int(query_start_loc[-1]),
        query_start_loc=torch.from_numpy(query_start_loc).to(torch.int32),
        seq_lens=torch.from_numpy(seq_lens).to(torch.int32),
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slot_mapping),
        max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens)


def run_both(spec: AttentionSpec, md: AttentionMetadata, dtype: torch.dtype,
             block_size: int, num_blocks: int, seed: int = 0, use_kernel: bool = True,
             key_growth: float = 0.0):
    """key_growth: cached keys at position p scaled by 1 + key_growth * p."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = md.num_actual_tokens
    # Random context everywhere: stale values in unused slots must never leak in.
    cache = torch.randn(2, num_blocks, block_size, spec.num_kv_heads, spec.head_size,
                        generator=gen)
    if key_growth:
        for r, seq_len in enumerate(md.seq_lens_cpu):
            for pos in range(int(seq_len) - int(md.query_start_loc_cpu[r + 1]
                                                 - md.query_start_loc_cpu[r])):
                block = md.block_table[r, pos // block_size]
                cache[0, block, pos % block_size] *= 1 + key_growth * pos
    cache = cache.to(dtype)
    q = torch.randn(num_tokens, spec.num_heads, spec.head_size, generator=gen).to(dtype)
    k = torch.randn(num_tokens, spec.num_kv_heads, spec.head_size, generator=gen).to(dtype)
    v = torch.randn(num_tokens, spec.num_kv_heads, spec.head_size, generator=gen).to(dtype)
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    expected = TorchRefAttention(spec).forward(q, k, v, ref_cache, md)
    actual = CpuAttention(spec, use_kernel).forward(q, k, v, cpu_cache, md)
    torch.testing.assert_close(cpu_cache, ref_cache, rtol=0, atol=0)
    return actual, expected


# float32: the kernels reduce in another order than the oracle (AVX-512 tiles, AVX2 8-lane
# items), so outputs carry float32 rounding of the scores: ~1e-6 relative of scores that
# reach ~40 with growing keys, up to 1.55e-5 absolute measured against a float64 oracle
# on an AVX2 CPU (Zen 3; the AVX-512 order happened to stay within 1e-5).
TOL = {torch.float32: dict(rtol=1e-5, atol=3e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}

# (num_computed, query_len) per request: decodes at block boundaries (15, 16, 17 tokens
# of context with block_size 16), fresh prefills, prefill chunks over cached context.
MIXED = [(15, 1), (0, 37), (16, 1), (40, 9), (31, 1), (0, 1), (5, 64), (100, 1), (47, 17)]


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 2), (6, 6), (4, 1)])  # GQA, MHA, MQA
@pytest.mark.parametrize("sliding_window", [None, 7, 32])
def test_cpu_matches_reference_on_mixed_batch(dtype, heads, sliding_window, use_kernel):
    num_heads, num_kv_heads = heads
    block_size, num_blocks = 16, 64
    spec = AttentionSpec(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32,
                         scale=32 ** -0.5, sliding_window=sliding_window)
    computed, query_lens = zip(*MIXED)
    md = make_metadata(list(computed), list(query_lens), block_size, num_blocks)
    actual, expected = run_both(spec, md, dtype, block_size, num_blocks, use_kernel=use_kernel)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


# head_size 20, 24 and 40 take the kernel's generic path (24 and 40 eight lanes wide where
# AVX2 is built: one vector of dims, then 32 + 8), 64 its AVX-512 one (where built).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
@pytest.mark.parametrize("head_size", [20, 24, 40, 64])
def test_cpu_odd_block_and_head_sizes(dtype, block_size, head_size):
    spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_size=head_size, scale=0.3,
                         sliding_window=20)
    num_blocks = 200
    computed, query_lens = [0, 13, 3, 29, 40], [11, 1, 26, 1, 35]
    md = make_metadata(computed, query_lens, block_size, num_blocks, seed=1)
    actual, expected = run_both(spec, md, dtype, block_size, num_blocks, seed=1)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_all_decode_batch(dtype):
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125)
    computed = [3, 16, 31, 32, 63, 200, 0, 77]
    md = make_metadata(computed, [1] * len(computed), 16, 64, seed=2)
    actual, expected = run_both(spec, md, dtype, 16, 64, seed=2)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_many_items_prefetching_the_next(dtype):
    """44 requests, so more than 8 work items per thread: each thread claims its next
    item before running the current one, whose last steps prefetch the next one's first
    keys. Contexts of one step (< 48 keys), two and many, decodes and prefill chunks, in
    an order the kernel's largest-first sort reshuffles."""
    spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_size=64, scale=0.125)
    computed = [(i * 37) % 260 for i in range(44)]
    query_lens = [1] * 40 + [20, 33, 5, 64]
    md = make_metadata(computed, query_lens, 16, 900, seed=6)
    actual, expected = run_both(spec, md, dtype, 16, 900, seed=6)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
def test_cpu_scores_growing_along_the_context(dtype, block_size, head_size):
    """Cached keys grow along the context, so later keys score far above earlier ones
    (by more than the 8 the bfloat16 tiles let a score exceed their lazy running max):
    the online softmax must rescale mid-row, in prefill chunks and decodes. (Head size
    128 runs the tiles' 3-row micro-kernels, 64 their 6-row ones; with AMX, 96 and 256
    take 3 and 8 steps of 32 dims per score.)"""
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_size=head_size,
                         scale=head_size ** -0.5)
    computed, query_lens = [200, 150, 120, 90], [20, 33, 1, 1]
    md = make_metadata(computed, query_lens, block_size, 200, seed=5)
    actual, expected = run_both(spec, md, dtype, block_size, 200, seed=5, key_growth=0.05)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_chunks_ending_in_a_single_token_tile(dtype):
    """Prefill chunks of 16k + 1 tokens end in one-token tiles (the decode code path),
    here over contexts much longer than any pure decode of the batch."""
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_size=64, scale=0.125)
    computed, query_lens = [0, 150, 3, 7], [17, 33, 1, 1]
    md = make_metadata(computed, query_lens, 16, 64, seed=3)
    actual, expected = run_both(spec, md, dtype, 16, 64, seed=3)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_reqs", [17, 70])
def test_cpu_decodes_sharing_a_prefix(dtype, head_size, num_reqs):
    """Decodes whose block tables share leading blocks (a prefix-cache hit; bfloat16 runs
    them as a cascade: the first 96 shared keys once for all rows, then each suffix,
    merged; 70 requests make the shared tiles 32 tokens). One request's context ends
    right after the shared blocks (its suffix is its own token)."""
    spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_size=head_size, scale=0.1)
    computed = [80, 95, 120, 200, 81, 150, 99, 130, 84, 170, 111, 96, 140, 88, 100, 230, 90]
    computed = [c + 32 for c in computed * 5][:num_reqs]
    md = make_metadata(computed, [1] * len(computed), 16, 300 * num_reqs // 17, seed=4)
    md.block_table[1:, :7] = md.block_table[0, :7]  # 112 shared keys
    actual, expected = run_both(spec, md, dtype, 16, 300 * num_reqs // 17, seed=4)
    torch.testing.assert_close(actual, expected, **TOL[dtype])
