"""reshape_and_cache: write this step's K/V [T, KVH, D] into the paged cache by slot.

An fp8 cache (attention/kv_quant.py) gets fp8(clamp(x / scale, -max, max)), rounded to
nearest even. The kernel computes the fp8 bits itself (c10's algorithm: integer ops and
one float add) and stores them as bytes, rather than casting with `.to(fp8)`: so the
bytes equal torch's conversion on a GPU and under TRITON_INTERPRET=1 alike (the
interpreter's own fp8 cast rounds values below the smallest normal wrongly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# fp8 cache dtype -> (largest finite value, mantissa bits, exponent bias).
_FP8_FORMATS = {torch.float8_e4m3fn: (448.0, 3, 7), torch.float8_e5m2: (57344.0, 2, 15)}


@triton.jit
def _fp8_bits(x, scale, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, BIAS: tl.constexpr):
    """fp8 bit patterns (int32, 0..255) of clamp(x / scale, -FP8_MAX, FP8_MAX); NaN stays
    NaN (0x7F)."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Below the smallest normal (2^(1 - BIAS)): adding 2^(24 - BIAS - MANT_BITS) rounds the
    # value to the subnormal grid and leaves its multiple of the step in the low bits.
    denorm_bits = (127 + 24 - BIAS - MANT_BITS) << 23
    denorm = tl.full(x.shape, denorm_bits, tl.int32).to(tl.float32, bitcast=True)
    sub = (mag.to(tl.float32, bitcast=True) + denorm).to(tl.int32, bitcast=True) - denorm_bits
    # Normal: rebias the exponent, round the mantissa to MANT_BITS bits (ties to even).
    shift = 23 - MANT_BITS
    odd = (mag >> shift) & 1
    normal = (mag + (((BIAS - 127) << 23) + (1 << (shift - 1)) - 1) + odd) >> shift
    out = tl.where(mag < ((128 - BIAS) << 23), sub, normal)
    out = tl.where(mag > 0x7F800000, 0x7F, out)
    return out | sign


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,  # [T, KVH, D]
    key_cache_ptr,  # [num_blocks, block_size, KVH, D] (kv_cache[0]; fp8: its bytes)
    value_cache_ptr,  # [num_blocks, block_size, KVH, D] (kv_cache[1]; fp8: its bytes)
    slot_mapping_ptr,  # [T] int64
    k_scale, v_scale,  # fp8 only
    stride_key_token, stride_key_head,
    stride_value_token, stride_value_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, BIAS: tl.constexpr,
):
    """One program per token: copies (or quantizes) its [KVH, D] key and value rows to
    their slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # NOTE: a negative slot marks a row that must not be written (masked, never an
    # out-of-bounds store); padded graph batches point at the null block instead.
    if slot < 0:
        return
    # slot = block_id * block_size + offset in the block.
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    # Both sizes are padded to powers of two (tl.arange needs them); the mask trims.
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE)
    key = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head
                  + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_value_token
                    + heads[:, None] * stride_value_head + dims[None, :], mask=mask)
    if IS_FP8:
        key = _fp8_bits(key, k_scale, FP8_MAX, MANT_BITS, BIAS).to(tl.uint8)
        value = _fp8_bits(value, v_scale, FP8_MAX, MANT_BITS, BIAS).to(tl.uint8)
    dst = (block_id * stride_cache_block + offset * stride_cache_slot
           + heads[:, None] * stride_cache_head + dims[None, :])
    tl.store(key_cache_ptr + dst, key, mask=mask)
    tl.store(value_cache_ptr + dst, value, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """Scatter key/value [T, KVH, D] into kv_cache [2, num_blocks, block_size, KVH, D] at
    slot_mapping [T] (int64, slot = block_id * block_size + offset; negative: skipped).
    An fp8 kv_cache stores K / k_scale and V / v_scale (other caches ignore the scales).

    A K/V dtype other than a non-fp8 cache's is converted by torch first, so rounding
    matches `backend.write_kv_cache` (the interpreter's own float32 -> bfloat16 cast
    truncates). The engine's K/V always have that dtype, so this copy never runs there.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    fp8 = _FP8_FORMATS.get(kv_cache.dtype)
    if fp8 is None:
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    else:
        kv_cache = kv_cache.view(torch.uint8)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert kv_cache.stride(-1) == 1, "the KV cache's head dim must be contiguous"
    fp8_max, mant_bits, bias = fp8 or (0.0, 0, 0)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=kv_cache.shape[2],
        IS_FP8=fp8 is not None, FP8_MAX=fp8_max, MANT_BITS=mant_bits, BIAS=bias)
