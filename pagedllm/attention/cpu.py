"""cpu: paged attention shaped for CPU speed.

The native kernel (csrc/cpu_attention.cpp, built on first use) writes K/V and attends the
whole mixed batch in one call, reading the context through the block table. Without a
C++ compiler the pure-torch path below runs instead:
- Decodes (query length 1) of the whole batch run as ONE SDPA call over their gathered
  contexts, padded to the longest and masked by length.
- Prefill chunks run one SDPA call per request (a block-diagonal mask over the whole
  batch would be O(T^2)).
- GQA never repeats K/V: the query heads of a group are folded into the query-length
  dimension, so each KV head is read once for its G query heads.
Layers with soft-capping or ALiBi use the reference path (only Gemma 2 / Bloom need it).
An fp8 cache (attention/kv_quant.py): the kernel converts K/V on the fly; the torch path
dequantizes the gathered context to the query's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.attention.backend import AttentionSpec, write_kv_cache
from pagedllm.attention.kv_quant import dequantize_kv, is_fp8
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import TorchRefAttention, gather_context


class CpuAttention:
    def __init__(self, spec: AttentionSpec, use_kernel: bool | None = None) -> None:
        self.spec = spec
        self.group = spec.num_heads // spec.num_kv_heads
        self._ref = None
        if spec.logits_soft_cap is not None or spec.alibi_slopes is not None:
            self._ref = TorchRefAttention(spec)
        # use_kernel=False forces the torch path (tests compare both).
        self.use_kernel = use_kernel is not False and cpu_ops.load_cpu_kernels()

    @property
    def runs_kernel(self) -> bool:
        """Whether every call goes to the native paged-attention kernel (not the torch
        path, nor the reference for soft-capped or ALiBi layers)."""
        return self.use_kernel and self._ref is None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        if self._ref is not None:
            return self._ref.forward(query, key, value, kv_cache, attn_metadata, k_scale,
                                     v_scale)
        md = attn_metadata
        if self.use_kernel:
            out = torch.empty_like(query)
            cpu_ops.paged_attention(
                out, query, key, value, kv_cache, md.slot_mapping, md.block_table,
                md.seq_lens, md.query_start_loc, self.spec.scale, self.spec.sliding_window,
                k_scale=k_scale, v_scale=v_scale)
            return out
        write_kv_cache(key, value, kv_cache, md.slot_mapping, k_scale, v_scale)
        return self._forward_torch(query, kv_cache, md, (k_scale, v_scale))

    def _forward_torch(self, query: torch.Tensor, kv_cache: torch.Tensor,
                       attn_metadata: AttentionMetadata, scales: tuple[float, float],
                       ) -> torch.Tensor:
        """Attention over the cache (this step's K/V already written); `scales`: (k_scale,
        v_scale) of an fp8 cache."""
        md = attn_metadata
        qsl = md.query_start_loc_cpu
        query_lens = qsl[1:] - qsl[:-1]
        # Requests are ordered as scheduled; decodes and prefills may interleave.
        is_decode = query_lens == 1
        out = torch.empty_like(query)
        if is_decode.all():
            return self._decode(query, kv_cache, scales, md.block_table, md.seq_lens,
                                md.max_seq_len)
        decode_rows = is_decode.nonzero()[0]
        if len(decode_rows):
            rows = torch.from_numpy(decode_rows).to(query.device)
            tok = torch.from_numpy(qsl[decode_rows]).to(query.device).long()
            out[tok] = self._decode(query[tok], kv_cache, scales, md.block_table[rows],
                                    md.seq_lens[rows], int(md.seq_lens_cpu[decode_rows].max()))
        for i in (~is_decode).nonzero()[0]:
            start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(md.seq_lens_cpu[i])
            out[start:end] = self._prefill(query[start:end], kv_cache, scales,
                                           md.block_table[i], seq_len)
        return out

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
                scales: tuple[float, float], block_table: torch.Tensor,
                seq_lens: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """query [R, H, D] (one token per request) -> [R, H, D]."""
        num_reqs, num_heads, head_size = query.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        num_blocks = -(-max_seq_len // block_size)
        blocks = block_table[:, :num_blocks].long()
        # [R, nb, B, KVH, D] -> [R, KVH, nb*B, D]
        k = kv_cache[0][blocks].flatten(1, 2).transpose(1, 2)
        v = kv_cache[1][blocks].flatten(1, 2).transpose(1, 2)
        k, v = _dequantized(k, v, scales, query.dtype)
        q = query.view(num_reqs, num_kv_heads, self.group, head_size)
        k_pos = torch.arange(num_blocks * block_size, device=query.device)
        q_pos = (seq_lens - 1).long()[:, None]  # [R, 1]
        visible = k_pos[None, :] <= q_pos
        if self.spec.sliding_window is not None:
            visible &= k_pos[None, :] > q_pos - self.spec.sliding_window
        mask = visible[:, None, None, :]  # [R, 1, 1, S]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.spec.scale)
        return out.reshape(num_reqs, num_heads, head_size)

    def _prefill(self, query: torch.Tensor, kv_cache: torch.Tensor,
                 scales: tuple[float, float], block_ids: torch.Tensor,
                 seq_len: int) -> torch.Tensor:
        """query [q_len, H, D] of one request whose context is seq_len long -> [q_len, H, D]."""
        q_len, num_heads, head_size = query.shape
        k, v = gather_context(kv_cache, block_ids, seq_len)  # [S, KVH, D]
        k, v = _dequantized(k, v, scales, query.dtype)
        num_kv_heads = k.shape[1]
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, S, D]
        # Fold the group into the query dim: row g * q_len + i is head (kvh, g), token i.
        q = query.view(q_len, num_kv_heads, self.group, head_size).permute(1, 2, 0, 3)
        q = q.reshape(num_kv_heads, self.group * q_len, head_size)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, S]
        if self.spec.sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - self.spec.sliding_window
        mask = visible.repeat(self.group, 1)  # [G*q_len, S]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.spec.scale)
        # [KVH, G*q_len, D] -> [q_len, H, D]
        out = out.view(num_kv_heads, self.group, q_len, head_size).permute(2, 0, 1, 3)
        return out.reshape(q_len, num_heads, head_size)


def _dequantized(k: torch.Tensor, v: torch.Tensor, scales: tuple[float, float],
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered fp8 K/V as `dtype` (SDPA needs the query's); other caches unchanged."""
    if not is_fp8(k.dtype):
        return k, v
    return dequantize_kv(k, scales[0], dtype), dequantize_kv(v, scales[1], dtype)
