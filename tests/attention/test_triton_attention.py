"""The `triton` attention backend's kernels against `write_kv_cache` (exact) and the
`torch_ref` oracle: on a GPU when there is one, else on CPU tensors under Triton's
interpreter.

NOTE: TRITON_INTERPRET must be set before the kernels are decorated (when
pagedllm.attention.triton is first imported), hence the assignment above the imports;
on a GPU machine it stays unset so that other tests' compiled kernels stay compiled.
The interpreter is slow (numpy per program), so batches are small and cases few.
"""

from __future__ import annotations

import dataclasses
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the triton backend needs the `triton` package")

from pagedllm.attention.backend import (AttentionSpec, get_attention_backend,  # noqa: E402
                                        write_kv_cache)
from pagedllm.attention.kv_quant import quantize_kv  # noqa: E402
from pagedllm.attention.metadata import AttentionMetadata  # noqa: E402
from pagedllm.attention.torch_ref import TorchRefAttention  # noqa: E402
from pagedllm.attention.triton.attention import TritonAttention  # noqa: E402
from pagedllm.attention.triton.cache import reshape_and_cache  # noqa: E402
from pagedllm.attention.triton.ops import (kernels_interpreted, paged_attention,  # noqa: E402
                                          use_split_kv)
from tests.attention.test_cpu_attention import make_metadata  # noqa: E402

if not ON_GPU and not kernels_interpreted():
    pytest.skip("pagedllm.attention.triton was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

# NOTE: the interpreter multiplies bfloat16 tiles in float32 (ops._dot_options); a GPU
# rounds the softmax weights to bfloat16 before P @ V, hence the wider tolerance.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=1e-2, atol=1e-2)}

# (num_computed, query_len) per request: decodes at block boundaries (15, 16, 17 tokens
# of context with block_size 16), fresh prefills, prefill chunks over cached context.
MIXED = [(15, 1), (0, 37), (16, 1), (40, 9), (31, 1), (0, 1), (5, 40), (100, 1), (47, 17)]
DECODES = [3, 16, 31, 32, 63, 130, 0, 77]  # num_computed of a decode-only batch


def run_both(spec: AttentionSpec, md: AttentionMetadata, dtype: torch.dtype,
             block_size: int, num_blocks: int, seed: int = 0, key_growth: float = 0.0,
             **triton_kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(triton output, torch_ref output) for random q/k/v over a random cache; asserts
    both wrote the same cache. key_growth: cached key at position p scaled by
    1 + key_growth * p (later keys dominate, so the online softmax rescales mid-row)."""
    gen = torch.Generator().manual_seed(seed)
    # Random context everywhere: stale values in unused slots must never leak in.
    cache = torch.randn(2, num_blocks, block_size, spec.num_kv_heads, spec.head_size,
                        generator=gen)
    if key_growth:
        qsl = md.query_start_loc_cpu
        for r, seq_len in enumerate(md.seq_lens_cpu):
            for pos in range(int(seq_len) - int(qsl[r + 1] - qsl[r])):
                cache[0, md.block_table[r, pos // block_size], pos % block_size] *= (
                    1 + key_growth * pos)
    cache = cache.to(DEVICE, dtype)
    num_tokens = md.num_actual_tokens
    q, k, v = (torch.randn(num_tokens, heads, spec.head_size, generator=gen).to(DEVICE, dtype)
               for heads in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads))
    md = on_device(md)
    ref_cache, triton_cache = cache.clone(), cache.clone()
    expected = TorchRefAttention(spec).forward(q, k, v, ref_cache, md)
    actual = TritonAttention(spec, **triton_kw).forward(q, k, v, triton_cache, md)
    torch.testing.assert_close(triton_cache, ref_cache, rtol=0, atol=0)
    return actual, expected


def on_device(md: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(
        md, query_start_loc=md.query_start_loc.to(DEVICE), seq_lens=md.seq_lens.to(DEVICE),
        block_table=md.block_table.to(DEVICE), slot_mapping=md.slot_mapping.to(DEVICE))


def check(spec: AttentionSpec, reqs: list[tuple[int, int]], dtype: torch.dtype = torch.float32,
          block_size: int = 16, num_blocks: int = 48, seed: int = 0, **kw) -> None:
    computed, query_lens = zip(*reqs)
    md = make_metadata(list(computed), list(query_lens), block_size, num_blocks, seed=seed)
    actual, expected = run_both(spec, md, dtype, block_size, num_blocks, seed=seed, **kw)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def test_registered_as_triton():
    assert get_attention_backend("triton") is TritonAttention


# --- reshape_and_cache ---------------------------------------------------------------

@pytest.mark.parametrize("dtype,cache_dtype,head_size", [
    (torch.float32, torch.float32, 24), (torch.bfloat16, torch.bfloat16, 64),
    (torch.float16, torch.float16, 80), (torch.float32, torch.bfloat16, 32)])
def test_reshape_and_cache_matches_write_kv_cache(dtype, cache_dtype, head_size):
    num_tokens, num_kv_heads, block_size, num_blocks = 21, 3, 16, 8
    gen = torch.Generator().manual_seed(0)
    # K and V as strided views of one fused [T, 3 * KVH * D] projection, as models make.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_size, generator=gen)
    qkv = qkv.to(DEVICE, dtype)
    k, v = qkv.view(num_tokens, 3 * num_kv_heads, head_size)[:, num_kv_heads:].chunk(2, 1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size,
                        generator=gen).to(DEVICE, cache_dtype)
    expected = cache.clone()
    write_kv_cache(k, v, expected, slots)
    reshape_and_cache(k, v, cache, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_reshape_and_cache_skips_negative_slots():
    k = torch.randn(4, 2, 16, device=DEVICE)
    v = torch.randn(4, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 3, 16, 2, 16, device=DEVICE)
    # Slot 16 + 3 is block 1, offset 3; slot -1 is written nowhere.
    reshape_and_cache(k, v, cache, torch.tensor([5, -1, 16 + 3, 47], device=DEVICE))
    flat = cache.view(2, -1, 2, 16)
    torch.testing.assert_close(flat[0, [5, 19, 47]], k[[0, 2, 3]], rtol=0, atol=0)
    torch.testing.assert_close(flat[1, [5, 19, 47]], v[[0, 2, 3]], rtol=0, atol=0)
    assert flat.count_nonzero() == 2 * 3 * 2 * 16


# --- mixed batches -------------------------------------------------------------------

@pytest.mark.parametrize("heads,dtype,block_size", [
    ((8, 2), torch.float32, 16),  # GQA
    ((4, 4), torch.float32, 32),  # MHA
    ((4, 1), torch.float32, 16),  # MQA
    ((8, 2), torch.bfloat16, 32),
    ((6, 2), torch.float16, 16),
])
def test_mixed_batch_matches_reference(heads, dtype, block_size):
    num_heads, num_kv_heads = heads
    spec = AttentionSpec(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32,
                         scale=32 ** -0.5)
    check(spec, MIXED, dtype, block_size)


@pytest.mark.parametrize("heads", [(8, 2), (3, 3), (6, 1)])
def test_prefill_chunks_spanning_query_tiles(heads):
    """16-row tiles: each chunk spans several query tiles (tile -> request found by the
    kernel's binary search), odd group sizes leave padded rows in every tile."""
    spec = AttentionSpec(num_heads=heads[0], num_kv_heads=heads[1], head_size=16,
                         scale=0.25)
    check(spec, [(0, 23), (15, 1), (9, 30), (33, 2), (0, 1)], block_m=16)


@pytest.mark.parametrize("sliding_window", [1, 7, 32])
def test_sliding_window(sliding_window):
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, scale=0.2,
                         sliding_window=sliding_window)
    check(spec, MIXED, block_m=16 if sliding_window == 7 else None)


@pytest.mark.parametrize("sliding_window,soft_cap,alibi", [
    (None, None, True), (None, 5.0, False), (20, 2.0, True)])
def test_alibi_and_soft_cap(sliding_window, soft_cap, alibi):
    slopes = tuple(2.0 ** -(i + 1) for i in range(6)) if alibi else None
    spec = AttentionSpec(num_heads=6, num_kv_heads=3, head_size=24, scale=0.5,
                         sliding_window=sliding_window, logits_soft_cap=soft_cap,
                         alibi_slopes=slopes)
    check(spec, MIXED)


def test_scores_growing_along_the_context():
    """Later keys score far above earlier ones: every tile raises the running max."""
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, scale=32 ** -0.5)
    check(spec, [(120, 20), (90, 1), (64, 1)], key_growth=0.05)


# --- split-KV ------------------------------------------------------------------------

@pytest.mark.parametrize("split_kv", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_decode(split_kv, dtype):
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=32, scale=32 ** -0.5)
    # 32-key partitions: contexts of up to 131 keys split in up to 5.
    check(spec, [(c, 1) for c in DECODES], dtype, split_kv=split_kv, partition_size=32)


@pytest.mark.parametrize("spec_kw", [dict(sliding_window=40),
                                     dict(logits_soft_cap=3.0, alibi_slopes=(0.5, 0.25))])
def test_split_kv_with_features(spec_kw):
    """A window leaves whole partitions empty (their partials must weigh nothing)."""
    spec = AttentionSpec(num_heads=2, num_kv_heads=1, head_size=16, scale=0.25, **spec_kw)
    check(spec, [(c, 1) for c in DECODES], split_kv=True, partition_size=32)


def test_split_kv_forced_on_mixed_batch():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25)
    check(spec, [(0, 23), (70, 1), (40, 9), (5, 1)], split_kv=True, partition_size=32,
          block_m=16)


def test_split_kv_heuristic():
    # Few decode programs over long contexts: split.
    assert use_split_kv(4, 1, 4096, 8, 512, target_programs=264)
    # Many programs already fill the GPU; short contexts; prefill chunks: don't.
    assert not use_split_kv(64, 1, 4096, 8, 512, target_programs=264)
    assert not use_split_kv(4, 1, 1000, 8, 512, target_programs=264)
    assert not use_split_kv(4, 7, 4096, 8, 512, target_programs=264)


def test_heuristic_picks_split_for_long_decodes(monkeypatch):
    """split_kv=None follows the heuristic: a 2-request decode batch over 71 keys with
    32-key partitions runs split (and still matches the reference)."""
    from pagedllm.attention.triton import attention

    chosen = []

    def recording(*args, split_kv, **kwargs):
        chosen.append(split_kv)
        return paged_attention(*args, split_kv=split_kv, **kwargs)

    monkeypatch.setattr(attention, "paged_attention", recording)
    spec = AttentionSpec(num_heads=2, num_kv_heads=1, head_size=16, scale=0.25)
    check(spec, [(70, 1), (20, 1)], partition_size=32, split_kv=None)
    assert chosen == [True]


# --- head and block sizes ------------------------------------------------------------

@pytest.mark.parametrize("head_size,block_size,dtype", [
    (16, 16, torch.float32), (24, 32, torch.float32), (32, 16, torch.bfloat16),
    (40, 32, torch.float32), (64, 16, torch.float16), (80, 16, torch.float32),
    (96, 32, torch.bfloat16), (128, 16, torch.float32), (256, 32, torch.float32),
    (48, 5, torch.float32),  # any block size works: keys are gathered one by one
])
def test_head_and_block_sizes(head_size, block_size, dtype):
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=head_size,
                         scale=head_size ** -0.5)
    check(spec, [(block_size - 1, 1), (0, 19), (block_size + 3, 6), (2 * block_size, 1)],
          dtype, block_size, num_blocks=24)


@pytest.mark.parametrize("spec_kw,match", [
    (dict(head_size=512), "head sizes"),
    (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
    (dict(alibi_slopes=(0.5,)), "alibi_slopes"),
    (dict(sliding_window=0), "sliding_window"),
])
def test_unsupported_configurations_raise(spec_kw, match):
    kw = dict(num_heads=4, num_kv_heads=2, head_size=64, scale=0.125) | spec_kw
    with pytest.raises(ValueError, match=match):
        TritonAttention(AttentionSpec(**kw))


# --- fp8 KV cache --------------------------------------------------------------------

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def run_fp8(spec: AttentionSpec, reqs: list[tuple[int, int]], dtype: torch.dtype,
            cache_dtype: torch.dtype, block_size: int, num_blocks: int = 48, seed: int = 0,
            scales: tuple[float, float] = (0.5, 2.0), **triton_kw) -> None:
    """Triton against torch_ref over the same random fp8 cache (torch_ref dequantizes):
    the same bytes written, outputs within the query dtype's tolerance."""
    computed, query_lens = zip(*reqs)
    md = on_device(make_metadata(list(computed), list(query_lens), block_size, num_blocks,
                                 seed=seed))
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, spec.num_kv_heads, spec.head_size,
                        generator=gen).mul(2).to(cache_dtype).to(DEVICE)
    q = torch.randn(md.num_actual_tokens, spec.num_heads, spec.head_size, generator=gen)
    k, v = (torch.randn(md.num_actual_tokens, spec.num_kv_heads, spec.head_size,
                        generator=gen).mul(2) for _ in range(2))
    q, k, v = (t.to(DEVICE, dtype) for t in (q, k, v))
    ref_cache, triton_cache = cache.clone(), cache.clone()
    expected = TorchRefAttention(spec).forward(q, k, v, ref_cache, md, *scales)
    actual = TritonAttention(spec, **triton_kw).forward(q, k, v, triton_cache, md, *scales)
    assert torch.equal(triton_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("cache_dtype,dtype,heads,block_size,sliding_window", [
    (torch.float8_e4m3fn, torch.float32, (8, 2), 16, None),
    (torch.float8_e5m2, torch.bfloat16, (8, 2), 32, None),
    (torch.float8_e4m3fn, torch.bfloat16, (4, 1), 16, 7),
    (torch.float8_e5m2, torch.float32, (6, 2), 32, 20),
], ids=["e4m3-f32-gqa", "e5m2-bf16-gqa-b32", "e4m3-bf16-mqa-window", "e5m2-f32-b32-window"])
def test_fp8_mixed_batch_matches_reference(cache_dtype, dtype, heads, block_size,
                                           sliding_window):
    spec = AttentionSpec(num_heads=heads[0], num_kv_heads=heads[1], head_size=32,
                         scale=32 ** -0.5, sliding_window=sliding_window)
    run_fp8(spec, MIXED, dtype, cache_dtype, block_size)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_split_kv_decode(cache_dtype):
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=32, scale=32 ** -0.5)
    run_fp8(spec, [(c, 1) for c in DECODES], torch.bfloat16, cache_dtype, 16,
            split_kv=True, partition_size=32)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_reshape_and_cache_is_torchs_conversion(cache_dtype, dtype):
    """Bytes = torch's conversion of clamp(x / scale): values of every magnitude (also
    below the smallest normal, where the interpreter's own fp8 cast misrounds), beyond
    the range (saturated, not NaN or inf), NaN."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 2, 32, generator=gen) * 10 ** torch.randint(-6, 5, (64, 2, 32),
                                                                      generator=gen).float()
    x[0, 0, :4] = torch.tensor([float("nan"), 1e9, -1e9, 2.0 ** -10])
    x = x.to(DEVICE, dtype)
    slots = torch.randperm(4 * 32, generator=gen)[:64].to(DEVICE)
    cache = torch.zeros(2, 4, 32, 2, 32, dtype=cache_dtype, device=DEVICE)
    reshape_and_cache(x, x.flip(-1), cache, slots, k_scale=0.37, v_scale=1.0)
    flat = cache.view(2, -1, 2, 32)
    assert torch.equal(flat[0, slots].view(torch.uint8),
                       quantize_kv(x, 0.37, cache_dtype).view(torch.uint8))
    assert torch.equal(flat[1, slots].view(torch.uint8),
                       quantize_kv(x.flip(-1), 1.0, cache_dtype).view(torch.uint8))
