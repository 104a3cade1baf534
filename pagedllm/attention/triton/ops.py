"""Launch wrappers of the paged-attention kernels: tile sizes, grids, split-KV choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.attention.kv_quant import is_fp8
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton.kernels import (_paged_attention_kernel,
                                               _reduce_partitions_kernel)

# Largest head size the kernels take (one [BLOCK_M, HEAD_PAD] float32 accumulator).
MAX_HEAD_SIZE = 256
# Keys per tile of the inner loop; a multiple of 16 (tl.dot's smallest dimension).
TILE_N = 32
# Query rows (tokens x group heads) per program: decode-only batches use the smallest
# tile tl.dot takes, batches with prefill chunks a larger one that reuses each K/V tile
# for more queries (smaller for head sizes over 128, see _launch_shape).
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
# Split-KV: keys per partition (a multiple of TILE_N) and the fewest programs an unsplit
# decode launch should have before splitting stops paying (used where the GPU's
# multiprocessor count is unknown).
DEFAULT_PARTITION_SIZE = 512
DEFAULT_TARGET_PROGRAMS = 128

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
              torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True)
class AttentionParams:
    """Per-layer constants of a launch (from the AttentionSpec)."""

    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    # [H] float32 on the query's device, or None.
    alibi_slopes: torch.Tensor | None = None


def kernels_interpreted() -> bool:
    """Whether the kernels were decorated under TRITON_INTERPRET=1 (run by Triton's
    interpreter on CPU tensors) rather than compiled for a GPU."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_paged_attention_kernel, InterpretedFunction)


def use_split_kv(num_reqs: int, max_query_len: int, max_seq_len: int, num_kv_heads: int,
                 partition_size: int, target_programs: int) -> bool:
    """Heuristic: split decode contexts into partitions when a plain launch would have
    too few programs to fill the GPU and contexts are long enough to split.

    A decode-only launch has num_reqs * num_kv_heads programs, each walking its whole
    context alone; with fewer than `target_programs` (about two per multiprocessor) the
    GPU idles while a few long contexts are read serially, and partitioning them costs
    only a small reduce. Contexts shorter than two partitions gain nothing.
    """
    return (max_query_len == 1 and num_reqs * num_kv_heads < target_programs
            and max_seq_len >= 2 * partition_size)


def paged_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                    md: AttentionMetadata, params: AttentionParams, split_kv: bool = False,
                    partition_size: int = DEFAULT_PARTITION_SIZE,
                    block_m: int | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """Attend query [T, H, D] (request rows per md.query_start_loc) over the contexts in
    kv_cache [2, num_blocks, block_size, KVH, D] (md.block_table, md.seq_lens); writes
    out [T, H, D] and returns it. Rows past md.num_actual_tokens (graph padding) are left
    untouched.

    split_kv: run the split-KV pair (partitions of `partition_size` keys, then a reduce).
    block_m: query rows per program (default by batch kind; tests shrink it so prefill
    chunks span several tiles).
    k_scale / v_scale: an fp8 kv_cache's scales (attention/kv_quant.py), else ignored.
    """
    if md.num_reqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    assert kv_cache.stride(-1) == 1, "the KV cache's head dim must be contiguous"
    block_table = md.block_table
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    head_pad = max(16, triton.next_power_of_2(head_size))
    shape = _launch_shape(md, num_heads // num_kv_heads, head_pad, query.dtype, block_m)
    num_partitions = 1
    part_max = part_sum = part_acc = out  # placeholders: only split launches use them
    if split_kv:
        assert partition_size % TILE_N == 0, "partitions must hold whole key tiles"
        num_partitions = triton.cdiv(md.max_seq_len, partition_size)
        part_max, part_sum, part_acc = _alloc_partials(md.num_actual_tokens, num_heads,
                                                       num_partitions, head_pad, query.device)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if not is_fp8(kv_cache.dtype):
        k_scale = v_scale = 1.0
    # Any tensor stands in for absent ALiBi slopes (never read).
    alibi = params.alibi_slopes if params.alibi_slopes is not None else md.seq_lens
    _paged_attention_kernel[(shape.num_tiles, num_kv_heads, num_partitions)](
        out, query, key_cache, value_cache, block_table, md.seq_lens,
        md.query_start_loc, alibi, part_max, part_sum, part_acc,
        md.num_reqs, num_partitions, params.scale * k_scale, float(v_scale),
        params.logits_soft_cap or 0.0,
        params.sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, HEAD_SIZE=head_size,
        HEAD_PAD=head_pad, BLOCK_SIZE=kv_cache.shape[2], BLOCK_Q=shape.block_q,
        BLOCK_M=shape.block_m, TILE_N=TILE_N, ONE_TILE_PER_REQ=shape.one_tile_per_req,
        IS_SPLIT=split_kv, PARTITION_SIZE=partition_size,
        USE_WINDOW=params.sliding_window is not None,
        USE_SOFT_CAP=params.logits_soft_cap is not None,
        USE_ALIBI=params.alibi_slopes is not None, num_warps=shape.num_warps,
        **_dot_options(query))
    if split_kv:
        _reduce_partitions_kernel[(md.num_actual_tokens, num_heads)](
            out, part_max, part_sum, part_acc, num_partitions, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
            PARTITIONS_PAD=triton.next_power_of_2(num_partitions))
    return out


@dataclass(frozen=True)
class _LaunchShape:
    block_m: int  # query rows (tokens x group heads) per program, a power of two >= 16
    block_q: int  # query tokens per program: block_m // group
    one_tile_per_req: bool  # every request's query fits one tile: tile i is request i
    num_tiles: int  # programs along grid axis 0
    num_warps: int


def _launch_shape(md: AttentionMetadata, group: int, head_pad: int, dtype: torch.dtype,
                  block_m: int | None) -> _LaunchShape:
    """Tile and warp counts. NOTE: sized so that sm_90 builds keep the float32
    accumulator, Q, K^T and V tiles in registers (no spills per ptxas): larger heads get
    fewer query rows, float32 tiles twice the warps."""
    is_fp32 = dtype == torch.float32
    if block_m is None:
        if md.max_query_len == 1:
            block_m = DECODE_BLOCK_M
        elif head_pad <= 128:
            block_m = PREFILL_BLOCK_M
        else:
            block_m = PREFILL_BLOCK_M // (4 if is_fp32 else 2)
    # A tile holds whole groups: at least one token's GROUP heads.
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    block_q = block_m // group
    num_warps = 8 if is_fp32 else 4
    if md.max_query_len <= block_q:
        return _LaunchShape(block_m, block_q, True, md.num_reqs, num_warps)
    # Request i's tiles are numbered from query_start_loc[i] // block_q + i
    # (kernels._find_request), so this many numbers cover every request.
    num_tiles = md.num_actual_tokens // block_q + md.num_reqs
    return _LaunchShape(block_m, block_q, False, num_tiles, num_warps)


def _alloc_partials(num_tokens: int, num_heads: int, num_partitions: int, head_pad: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split-KV partials: row max and row sum [T, H, P], accumulator [T, H, P, HEAD_PAD]
    (float32). NOTE: allocated per call (the caching allocator makes this cheap, and
    graph capture keeps the buffers); only few-row decode batches split."""
    part_max = torch.empty((num_tokens, num_heads, num_partitions), dtype=torch.float32,
                           device=device)
    part_acc = torch.empty((num_tokens, num_heads, num_partitions, head_pad),
                           dtype=torch.float32, device=device)
    return part_max, torch.empty_like(part_max), part_acc


def _dot_options(query: torch.Tensor) -> dict:
    """tl.dot operand dtype and precision.

    float32 runs IEEE (tf32 would lose float32 parity with torch_ref). NOTE: CPU tensors
    mean the interpreter, whose tl.dot multiplies bfloat16's raw bits (numpy has no
    bfloat16), so there bfloat16 tiles are widened to float32 first; on a GPU they stay
    bfloat16 for the tensor cores.
    """
    dtype = query.dtype
    if dtype not in _TL_DTYPES:
        raise ValueError(f"triton attention supports float32/float16/bfloat16, got {dtype}")
    if dtype == torch.bfloat16 and query.device.type == "cpu":
        dtype = torch.float32
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return dict(DOT_DTYPE=_TL_DTYPES[dtype], DOT_PRECISION=precision)
