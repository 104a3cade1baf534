"""TritonAttention: the `triton` backend (CUDA; CPU tensors under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionSpec
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton.cache import reshape_and_cache
from pagedllm.attention.triton.ops import (DEFAULT_PARTITION_SIZE, DEFAULT_TARGET_PROGRAMS,
                                           MAX_HEAD_SIZE, TILE_N, AttentionParams,
                                           kernels_interpreted, paged_attention,
                                           use_split_kv)


class TritonAttention:
    """Writes K/V with `reshape_and_cache` (quantized into an fp8 cache), then attends the
    whole mixed batch in one launch of the varlen paged-attention kernel, or, for
    decode-only batches that the `use_split_kv` heuristic picks, in the split-KV kernel
    pair.

    split_kv: None lets the heuristic choose; True / False force it (tests).
    partition_size: keys per split-KV partition (a multiple of ops.TILE_N).
    block_m: query rows per program (None: by batch kind); tests shrink it.
    """

    def __init__(self, spec: AttentionSpec, split_kv: bool | None = None,
                 partition_size: int = DEFAULT_PARTITION_SIZE,
                 block_m: int | None = None) -> None:
        _check_spec(spec)
        if not torch.cuda.is_available() and not kernels_interpreted():
            raise ValueError("the triton attention backend needs a CUDA GPU (on CPU its "
                             "kernels run only under TRITON_INTERPRET=1, set before "
                             "pagedllm.attention.triton is imported)")
        if partition_size < TILE_N or partition_size % TILE_N:
            raise ValueError(f"partition_size must be a positive multiple of {TILE_N}, "
                             f"got {partition_size}")
        self.spec = spec
        self.split_kv = split_kv
        self.partition_size = partition_size
        self.block_m = block_m
        # Filled on the first forward, on the query's device.
        self._params: AttentionParams | None = None
        self._target_programs = DEFAULT_TARGET_PROGRAMS

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        md = attn_metadata
        if self._params is None:
            self._params = self._make_params(query.device)
        reshape_and_cache(key, value, kv_cache, md.slot_mapping, k_scale, v_scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, H, D]
        split = self.split_kv
        if md.static_shapes:
            # A CUDA graph: the partition count would follow the step's longest context.
            split = False
        elif split is None:
            split = use_split_kv(md.num_reqs, md.max_query_len, md.max_seq_len,
                                 self.spec.num_kv_heads, self.partition_size,
                                 self._target_programs)
        return paged_attention(out, query, kv_cache, md, self._params, split_kv=split,
                               partition_size=self.partition_size, block_m=self.block_m,
                               k_scale=k_scale, v_scale=v_scale)

    def _make_params(self, device: torch.device) -> AttentionParams:
        spec = self.spec
        slopes = None
        if spec.alibi_slopes is not None:
            slopes = torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=device)
        if device.type == "cuda":
            # About two resident programs per multiprocessor fill the GPU.
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            self._target_programs = 2 * sms
        return AttentionParams(scale=spec.scale, sliding_window=spec.sliding_window,
                               logits_soft_cap=spec.logits_soft_cap, alibi_slopes=slopes)


def _check_spec(spec: AttentionSpec) -> None:
    """Reject layers the kernels cannot run, at construction rather than by a wrong
    answer. (Any block size works: keys are gathered one by one through the table.)"""
    if not 1 <= spec.head_size <= MAX_HEAD_SIZE:
        raise ValueError(f"triton attention supports head sizes 1..{MAX_HEAD_SIZE}, "
                         f"got {spec.head_size}")
    if spec.num_kv_heads < 1 or spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"num_heads ({spec.num_heads}) must be a multiple of "
                         f"num_kv_heads ({spec.num_kv_heads})")
    if spec.sliding_window is not None and spec.sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {spec.sliding_window}")
    if spec.logits_soft_cap is not None and spec.logits_soft_cap <= 0:
        raise ValueError(f"logits_soft_cap must be > 0, got {spec.logits_soft_cap}")
    if spec.alibi_slopes is not None and len(spec.alibi_slopes) != spec.num_heads:
        raise ValueError(f"alibi_slopes has {len(spec.alibi_slopes)} entries for "
                         f"{spec.num_heads} heads")
