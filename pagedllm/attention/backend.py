"""Attention backend interface and the name registry (lazy imports).

A backend writes the step's K/V into the paged cache through `slot_mapping`, then
attends each request's queries over its context read through `block_table`. Batches mix
prefill chunks (causal within the chunk, full over the cached context) and decodes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.attention.kv_quant import is_fp8, quantize_kv, raw_bytes
from pagedllm.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionSpec:
    """Static shape and features of one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    # Keys older than this many positions are masked (None: full attention).
    sliding_window: int | None = None
    # tanh soft-capping of attention scores (Gemma 2).
    logits_soft_cap: float | None = None
    # ALiBi per-head slopes (Bloom); None for rotary / learned positions.
    alibi_slopes: tuple[float, ...] | None = None


class AttentionImpl(Protocol):
    """What every backend implements."""

    def __init__(self, spec: AttentionSpec) -> None: ...

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D], kv_cache [2, num_blocks, block_size, KVH, D]
        -> output [T, H, D]. An fp8 kv_cache stores K / k_scale and V / v_scale
        (attention/kv_quant.py); other caches ignore the scales."""
        ...


# name -> (module, class); modules are imported only when chosen.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch_ref": ("pagedllm.attention.torch_ref", "TorchRefAttention"),
    "cpu": ("pagedllm.attention.cpu", "CpuAttention"),
    "triton": ("pagedllm.attention.triton.attention", "TritonAttention"),
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> type[AttentionImpl]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {available_backends()}")
    module, cls = _BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.startswith("pagedllm"):
            raise
        raise ValueError(f"attention backend {name!r} needs the {e.name!r} package "
                         f"(pip install 'pagedllm[cuda]')") from e


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """Scatter this step's K/V [T, KVH, D] into their cache slots (an fp8 cache gets
    quantize_kv(K, k_scale) and quantize_kv(V, v_scale)).

    NOTE: the eager runner never pads, so slot_mapping holds no -1 here; checking for it
    would cost a device sync per layer. Padded (graph-captured) batches must point their
    padding at the null block's slots instead.
    """
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    # [2, num_blocks * block_size, KVH, D] view: a slot indexes the flattened block dims.
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    if is_fp8(flat.dtype):
        key, value = quantize_kv(key, k_scale, flat.dtype), quantize_kv(value, v_scale, flat.dtype)
    # (torch has no CPU index_copy_ for fp8: the bytes are copied instead.)
    flat = raw_bytes(flat)
    flat[0].index_copy_(0, slot_mapping, raw_bytes(key.to(kv_cache.dtype)))
    flat[1].index_copy_(0, slot_mapping, raw_bytes(value.to(kv_cache.dtype)))
