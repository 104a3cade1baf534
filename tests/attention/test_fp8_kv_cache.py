"""fp8 KV cache (attention/kv_quant.py) in the `cpu` backend: the native kernel (and the
torch fallback) against the `torch_ref` oracle, which dequantizes the same cache; the
kernel's writes byte-for-byte against torch's conversion; its reads exact for every fp8
code; values beyond the fp8 range saturate instead of becoming NaN."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backend import AttentionSpec, write_kv_cache
from pagedllm.attention.cpu import CpuAttention
from pagedllm.attention.kv_quant import (dequantize_kv, kv_cache_torch_dtype, quantize_kv,
                                         raw_bytes)
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import TorchRefAttention
from pagedllm.kernels.cpu import ops as cpu_ops
from tests.attention.test_cpu_attention import MIXED, TOL, make_metadata

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


def fp8_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
              dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A random fp8 cache everywhere: stale values in unused slots must never leak in."""
    values = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    return quantize_kv(values * 2, 1.0, dtype)


def run_fp8(spec: AttentionSpec, md: AttentionMetadata, dtype: torch.dtype,
            cache_dtype: torch.dtype, block_size: int, num_blocks: int, seed: int = 0,
            scales: tuple[float, float] = (1.0, 1.0), use_kernel: bool = True,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cpu output, torch_ref output) over the same fp8 cache; asserts both wrote the
    same bytes."""
    gen = torch.Generator().manual_seed(seed)
    cache = fp8_cache(num_blocks, block_size, spec.num_kv_heads, spec.head_size,
                      cache_dtype, gen)
    num_tokens = md.num_actual_tokens
    q = torch.randn(num_tokens, spec.num_heads, spec.head_size, generator=gen).to(dtype)
    k, v = (torch.randn(num_tokens, spec.num_kv_heads, spec.head_size, generator=gen)
            .mul(2).to(dtype) for _ in range(2))
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    expected = TorchRefAttention(spec).forward(q, k, v, ref_cache, md, *scales)
    actual = CpuAttention(spec, use_kernel).forward(q, k, v, cpu_cache, md, *scales)
    assert torch.equal(raw_bytes(cpu_cache), raw_bytes(ref_cache))
    return actual, expected


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 1)])  # GQA, MQA
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("block_size", [16, 32])
def test_fp8_matches_reference_on_mixed_batch(use_kernel, cache_dtype, dtype, heads,
                                              sliding_window, block_size):
    spec = AttentionSpec(num_heads=heads[0], num_kv_heads=heads[1], head_size=64,
                         scale=64 ** -0.5, sliding_window=sliding_window)
    computed, query_lens = zip(*MIXED)
    md = make_metadata(list(computed), list(query_lens), block_size, 64)
    actual, expected = run_fp8(spec, md, dtype, cache_dtype, block_size, 64,
                               scales=(0.5, 2.0), use_kernel=use_kernel)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


# Head sizes: 32 / 128 (other tile shapes), 80 (an fp8 row that is not a multiple of 64
# bytes), 24 (the generic path); block size 5 has no bfloat16 tile pass.
@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size,block_size", [(32, 16), (128, 32), (80, 16), (24, 16),
                                                  (64, 5)])
def test_fp8_head_and_block_sizes(cache_dtype, dtype, head_size, block_size):
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_size=head_size, scale=0.3,
                         sliding_window=20)
    computed, query_lens = [0, 13, 3, 29, 40], [11, 1, 26, 1, 35]
    md = make_metadata(computed, query_lens, block_size, 200, seed=1)
    actual, expected = run_fp8(spec, md, dtype, cache_dtype, block_size, 200, seed=1)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_decodes_sharing_a_prefix(cache_dtype, dtype):
    """17 decodes sharing 80 keys: bfloat16 runs the shared-prefix cascade over fp8."""
    spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_size=64, scale=0.1)
    computed = [80, 95, 120, 200, 81, 150, 99, 130, 84, 170, 111, 96, 140, 88, 100, 230, 90]
    md = make_metadata(computed, [1] * len(computed), 16, 300, seed=4)
    md.block_table[1:, :5] = md.block_table[0, :5]
    actual, expected = run_fp8(spec, md, dtype, cache_dtype, 16, 300, seed=4)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def _kernel_write(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x [N] (N a multiple of 16) written as K and V through the native kernel (rows of 16
    elements, one token each); returns the cached K elements in order."""
    head_size, block_size = 16, 16
    num_tokens = x.numel() // head_size
    key = x.view(num_tokens, 1, head_size)
    cache = torch.zeros(2, num_tokens // block_size + 2, block_size, 1, head_size,
                        dtype=cache_dtype)
    slots = torch.arange(num_tokens, dtype=torch.int64) + block_size  # after the null block
    query = key[:1].clone()
    one = torch.ones(1, dtype=torch.int32)
    cpu_ops.paged_attention(torch.empty_like(query), query, key, key, cache, slots,
                            one.view(1, 1), one, torch.tensor([0, 1], dtype=torch.int32),
                            1.0, None, k_scale=scale, v_scale=scale)
    return cache[0].view(-1, head_size)[block_size:block_size + num_tokens].reshape(-1)


def _every_16_bit_value(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)


SPECIAL = [float("nan"), float("inf"), -float("inf"), 448.0, 448.5, 464.0, 479.9, 480.0,
           1e-45, -1e-45, 1e-39, 57344.0, 61439.0, 61440.0, 65536.0, 1e30, 0.0, -0.0,
           2.0 ** -10, 2.0 ** -10 * 1.0001, 2.0 ** -17, 3 * 2.0 ** -11, 2.0 ** -6, 2.0 ** -14]


def kernel_writes(cache_dtype: torch.dtype) -> list[tuple[torch.Tensor, float, torch.Tensor]]:
    """(x, scale, the native kernel's cached bytes of x / scale) for every bfloat16 and
    float16 value, and float32 values of every magnitude, NaN, inf and denormals, at three
    scales."""
    gen = torch.Generator().manual_seed(0)
    exponents = torch.randint(-12, 6, (1 << 16,), generator=gen).float()
    floats = torch.randn(1 << 16, generator=gen) * 10 ** exponents
    special = torch.tensor(SPECIAL + [0.0] * (-len(SPECIAL) % 16))
    return [(x, scale, raw_bytes(_kernel_write(x, cache_dtype, scale)))
            for scale in (1.0, 0.37, 4.0)
            for x in (_every_16_bit_value(torch.bfloat16), _every_16_bit_value(torch.float16),
                      torch.cat([floats, special]))]


def kernel_reads(cache_dtype: torch.dtype, dtype: torch.dtype, head_size: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the native kernel's output, the expected values) of queries whose only visible key
    is position 0, over V rows holding all 256 fp8 codes: torch's float conversion of
    each code times v_scale (2)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    rows = -(-256 // head_size)
    values = torch.zeros(rows * head_size, dtype=torch.uint8)
    values[:256] = codes
    spec = AttentionSpec(num_heads=1, num_kv_heads=1, head_size=head_size, scale=1.0)
    cache = torch.zeros(2, rows + 1, 1, 1, head_size, dtype=torch.uint8)
    cache[1, 1:, 0, 0] = values.view(rows, head_size)  # V of block b at block b + 1
    cache = cache.view(cache_dtype)
    md = make_metadata([0] * rows, [1] * rows, 1, rows + 1)
    md.block_table[:, 0] = torch.arange(1, rows + 1, dtype=torch.int32)
    query = torch.ones(rows, 1, head_size, dtype=dtype)
    # No key/value: the kernel only reads.
    out = CpuAttention(spec, True).forward(query, None, None, cache, md, v_scale=2.0)
    return out.float(), values.view(cache_dtype).float().view(rows, 1, head_size) * 2.0


@pytest.mark.skipif(not cpu_ops.load_cpu_kernels(), reason="native CPU kernels not built")
@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
def test_kernel_writes_torchs_conversion(cache_dtype):
    """Cached bytes = torch's conversion of clamp(x / scale) (kernel_writes' values)."""
    for x, scale, got in kernel_writes(cache_dtype):
        assert torch.equal(got, raw_bytes(quantize_kv(x, scale, cache_dtype))), scale


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_is_torchs_conversion(cache_dtype, dtype):
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(21, 3, 32, generator=gen) * 300).to(dtype)
    v = torch.randn(21, 3, 32, generator=gen).to(dtype)
    cache = torch.zeros(2, 4, 8, 3, 32, dtype=cache_dtype)
    slots = torch.randperm(32, generator=gen)[:21]
    write_kv_cache(k, v, cache, slots, k_scale=0.5, v_scale=0.25)
    flat = cache.view(2, -1, 3, 32)
    assert torch.equal(raw_bytes(flat[0, slots]), raw_bytes(quantize_kv(k, 0.5, cache_dtype)))
    assert torch.equal(raw_bytes(flat[1, slots]), raw_bytes(quantize_kv(v, 0.25, cache_dtype)))


@pytest.mark.skipif(not cpu_ops.load_cpu_kernels(), reason="native CPU kernels not built")
@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 24])
def test_kernel_reads_every_fp8_code_exactly(cache_dtype, dtype, head_size):
    """Every fp8 code reads back as torch's float conversion times v_scale (NaN codes as
    NaN; every finite fp8 value is exact in bfloat16)."""
    out, expected = kernel_reads(cache_dtype, dtype, head_size)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ["kernel", "torch", "torch_ref"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
def test_values_beyond_the_fp8_range_saturate(backend, cache_dtype):
    """K/V far beyond the fp8 range are stored as +-max (torch's own conversion would
    give NaN for e4m3fn in some paths, inf for e5m2), so attention stays finite."""
    limit = torch.finfo(cache_dtype).max
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, scale=32 ** -0.5)
    md = make_metadata([0, 5], [9, 1], 16, 8)
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(10, 2, 32, generator=gen) * 1e6
    v = torch.randn(10, 2, 32, generator=gen) * 1e6
    q = torch.randn(10, 4, 32, generator=gen)
    cache = torch.zeros(2, 8, 16, 2, 32, dtype=cache_dtype)
    if backend == "torch_ref":
        out = TorchRefAttention(spec).forward(q, k, v, cache, md)
    else:
        out = CpuAttention(spec, backend == "kernel").forward(q, k, v, cache, md)
    stored = cache.view(2, -1, 2, 32)[:, md.slot_mapping].float()
    assert torch.isfinite(stored).all() and torch.isfinite(out).all()
    assert stored.abs().max() == limit


def test_dequantize_and_dtype_names():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_torch_dtype("fp8_e4m3", torch.bfloat16) is torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float32) is torch.float8_e5m2
    with pytest.raises(ValueError, match="fp8_e4m3"):
        kv_cache_torch_dtype("int8", torch.float32)
    x = quantize_kv(torch.tensor([1.0, -3.0, 1000.0]), 2.0, torch.float8_e4m3fn)
    assert dequantize_kv(x, 2.0).tolist() == [1.0, -3.0, 896.0]  # 1000 / 2 -> 448 -> x2
