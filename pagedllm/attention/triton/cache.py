"""reshape_and_cache: write this step's K/V [T, KVH, D] into the paged cache by slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,  # [T, KVH, D]
    key_cache_ptr,  # [num_blocks, block_size, KVH, D] (kv_cache[0])
    value_cache_ptr,  # [num_blocks, block_size, KVH, D] (kv_cache[1])
    slot_mapping_ptr,  # [T] int64
    stride_key_token, stride_key_head,
    stride_value_token, stride_value_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copies its [KVH, D] key and value rows to their slot."""
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
    dst = (block_id * stride_cache_block + offset * stride_cache_slot
           + heads[:, None] * stride_cache_head + dims[None, :])
    tl.store(key_cache_ptr + dst, key, mask=mask)
    tl.store(value_cache_ptr + dst, value, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, KVH, D] into kv_cache [2, num_blocks, block_size, KVH, D] at
    slot_mapping [T] (int64, slot = block_id * block_size + offset; negative: skipped).

    A K/V dtype other than the cache's is converted by torch first, so rounding matches
    `backend.write_kv_cache` (the interpreter's own float32 -> bfloat16 cast truncates).
    The engine's K/V always have the cache dtype, so this copy never runs there.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert kv_cache.stride(-1) == 1, "the KV cache's head dim must be contiguous"
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=kv_cache.shape[2])
