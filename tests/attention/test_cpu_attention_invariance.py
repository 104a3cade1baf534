"""Batch invariance of the native attention in every dtype (DESIGN.md §10): a query row's
output is bit-identical whether its token is decoded alone, decoded in a batch (with the
shared-prefix cascade or without), or sits anywhere in a prefill chunk of any length over
any cached context, with and without a sliding window; in bfloat16 with a bfloat16 or an
fp8 KV cache (converted on the fly into the same tile pass), with blocks of 16 (the tile
pass) or 8 tokens (the chunk pass); in float32 and float16; with head size 40 (the generic
item, 8 lanes wide where AVX2 is built)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.backend import AttentionSpec
from pagedllm.attention.cpu import CpuAttention
from pagedllm.attention.kv_quant import quantize_kv
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.cpu.ops import load_cpu_kernels

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="native CPU ops not built")

BLOCK = 16
LEN = 230  # the subject request's context: 14.4 blocks, crosses several 48-key steps
HEADS, KV_HEADS, HEAD_SIZE = 6, 2, 64
NUM_BLOCKS = 200


def _tables():
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_SIZE, generator=gen)
    queries = torch.randn(LEN, HEADS, HEAD_SIZE, generator=gen)
    return cache, queries


CACHE, QUERIES = _tables()
# 8 query heads (a group of 4 per KV head) from the same table: its 6 and two more.
QUERIES8 = torch.cat([QUERIES, QUERIES[:, :2].flip(-1)], dim=1)
# The subject's blocks: 1, 2, ... in order; other requests share its first blocks or
# own blocks from 100 on.
SUBJECT_BLOCKS = list(range(1, -(-LEN // BLOCK) + 1))


def _attend(reqs: list[tuple[list[int], int, int]], sliding_window: int | None,
            subject_query: int = 0, dtype: torch.dtype = torch.bfloat16,
            cache_dtype: torch.dtype = torch.bfloat16, block: int = BLOCK,
            head_size: int = HEAD_SIZE, num_heads: int = HEADS) -> torch.Tensor:
    """Attention of a batch of (block ids, num_computed, query_len) requests, request
    `subject_query` being the subject; returns the subject's output rows. Every request's
    keys are its blocks' cached K/V (the step writes back the same values: an fp8 value
    is exact in bfloat16 and converts back to itself). Block ids count blocks of 16; with
    `block` = 8 each is split in two (the same slots, so the same cache bytes). A
    `head_size` below HEAD_SIZE takes the first dims of the tables; `num_heads` (6 or
    8) the first query heads of QUERIES8."""
    seq_lens = np.array([c + q for _, c, q in reqs])
    max_blocks = max(len(b) for b, _, _ in reqs)
    table = np.zeros((len(reqs), max_blocks), dtype=np.int32)
    qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
    slots, q_rows = [], []
    for i, (blocks, computed, qlen) in enumerate(reqs):
        table[i, :len(blocks)] = blocks
        qsl[i + 1] = qsl[i] + qlen
        pos = np.arange(computed, computed + qlen)
        slots.append(table[i, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK)
        # Other requests' queries: any values (they must not matter).
        queries = QUERIES8[:, :num_heads, :head_size]
        q_rows.append(queries[pos % LEN] if i == subject_query else
                      queries[(pos * 7 + 3) % LEN].flip(-1))
    if block != BLOCK:
        split = BLOCK // block
        table = (table[:, :, None] * split + np.arange(split, dtype=np.int32)).reshape(
            len(reqs), -1)
    slot_mapping = torch.from_numpy(np.concatenate(slots))
    md = AttentionMetadata(
        num_reqs=len(reqs), num_actual_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl).to(torch.int32),
        seq_lens=torch.from_numpy(seq_lens).to(torch.int32),
        block_table=torch.from_numpy(table), slot_mapping=slot_mapping,
        max_query_len=max(q for _, _, q in reqs), max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    cache = CACHE[..., :head_size].to(dtype)
    if cache_dtype != dtype:
        cache = quantize_kv(cache, 1.0, cache_dtype)
    flat = cache.reshape(2, NUM_BLOCKS * BLOCK, KV_HEADS, head_size)
    k = flat[0, slot_mapping].to(dtype)
    v = flat[1, slot_mapping].to(dtype)
    cache = cache.contiguous().view(2, -1, block, KV_HEADS, head_size)
    spec = AttentionSpec(num_heads=num_heads, num_kv_heads=KV_HEADS, head_size=head_size,
                         scale=head_size ** -0.5, sliding_window=sliding_window)
    out = CpuAttention(spec, True).forward(torch.cat(q_rows).to(dtype), k, v, cache, md)
    out = out.view(-1, num_heads, head_size)
    return out[qsl[subject_query]:qsl[subject_query + 1]]


def _other(i: int, shared_blocks: int, length: int) -> tuple[list[int], int, int]:
    """A decoding request sharing the subject's first `shared_blocks` blocks."""
    own = list(range(100 + 8 * i, 100 + 8 * i + 8))
    blocks = SUBJECT_BLOCKS[:shared_blocks] + own
    return blocks[:-(-length // BLOCK)], length - 1, 1


BF16 = torch.bfloat16
F32 = torch.float32
# (query dtype, cache dtype, block size, head size[, query heads: 6 by default]). On AVX2
# the generic item runs rows that see the same keys of a step together: with an fp8
# cache, in fours or threes, with a float32 one in pairs. With groups of 3 a prefill
# chunk's step that every token sees fully runs rows in fours across tokens, where a
# decode runs its 3 rows as a three: float32 outputs (f32-e4m3, f32-e5m2) show any
# difference in those passes' arithmetic, which bfloat16 rounding hides. Groups of 4
# (8 query heads) run each token's rows as a four everywhere; with a float32 cache, in
# pairs, or alone where a pair's partner sees none of the step.
CASES = {"bf16": (BF16, BF16, 16, 64), "e4m3": (BF16, torch.float8_e4m3fn, 16, 64),
         "e5m2": (BF16, torch.float8_e5m2, 16, 64), "bf16-block8": (BF16, BF16, 8, 64),
         "f32": (F32, F32, 16, 64), "f32-block8": (F32, F32, 8, 64),
         "f16": (torch.float16, torch.float16, 16, 64),
         "f32-head40": (F32, F32, 16, 40), "f32-head40-block8": (F32, F32, 8, 40),
         "bf16-head40": (BF16, BF16, 16, 40),
         "bf16-group4": (BF16, BF16, 16, 64, 8),
         "f32-e4m3": (F32, torch.float8_e4m3fn, 16, 64),
         "f32-e5m2": (F32, torch.float8_e5m2, 16, 64),
         "f32-e4m3-group4": (F32, torch.float8_e4m3fn, 16, 64, 8),
         "f32-group4": (F32, F32, 16, 64, 8)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sliding_window", [None, 37])
def test_a_row_is_bit_identical_in_every_batch_shape(sliding_window, case):
    dtype, cache_dtype, block, head_size, *heads = CASES[case]


    def attend(reqs, subject_query=0):
        return _attend(reqs, sliding_window, subject_query, dtype, cache_dtype, block,
                       head_size, *heads)

    # Reference: every position decoded alone.
    alone = {p: attend([(SUBJECT_BLOCKS, p, 1)])[0]
             for p in (0, 1, 15, 16, 47, 48, 49, 95, 96, 150, LEN - 1)}
    # Prefill chunks of several sizes over several cached contexts.
    for computed, qlen in [(0, LEN), (0, 50), (40, 60), (47, 2), (95, 56), (149, LEN - 149),
                           (200, LEN - 200)]:
        rows = attend([(SUBJECT_BLOCKS, computed, qlen)])
        for p, expected in alone.items():
            if computed <= p < computed + qlen:
                assert torch.equal(rows[p - computed], expected), (computed, qlen, p)
    # Decode batches: 11 other requests sharing the first 12 blocks (a cascade, when
    # there is no window), the first 10 (160 keys: the AMX pass's cascade ends there,
    # the tile pass's at 144) or nothing, the subject first, in the middle or last.
    for shared in (12, 10, 0):
        others = [_other(i, shared, 200 + 3 * i) for i in range(11)]
        for at in (0, 5, 11):
            batch = others[:at] + [(SUBJECT_BLOCKS, LEN - 1, 1)] + others[at:]
            row = attend(batch, subject_query=at)[0]
            assert torch.equal(row, alone[LEN - 1]), (shared, at)
    # A mixed batch: prefill chunks of other requests around the subject's decode.
    mixed = [(list(range(150, 160)), 0, 33), (SUBJECT_BLOCKS, 150, 1),
             (list(range(160, 170)), 20, 40)]
    assert torch.equal(attend(mixed, subject_query=1)[0], alone[150])
