"""torch_ref: the plainest correct paged attention, the oracle other backends are tested
against. One loop over requests, scores in float32, every feature spelled out."""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionSpec, write_kv_cache
from pagedllm.attention.kv_quant import dequantize_kv
from pagedllm.attention.metadata import AttentionMetadata


def gather_context(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [seq_len, KVH, D] of one request, read block by block in logical order."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[:, block_ids[:num_blocks].long()]  # [2, nb, block_size, KVH, D]
    k = blocks[0].flatten(0, 1)[:seq_len]
    v = blocks[1].flatten(0, 1)[:seq_len]
    return k, v


def attention_bias(spec: AttentionSpec, q_pos: torch.Tensor, k_pos: torch.Tensor,
                   ) -> torch.Tensor:
    """Additive [H or 1, q_len, k_len] float32 bias: causal + sliding-window masks, ALiBi."""
    rel = k_pos[None, :] - q_pos[:, None]  # [q_len, k_len]; <= 0 for visible keys
    allowed = rel <= 0
    if spec.sliding_window is not None:
        # A query sees itself and the sliding_window - 1 keys before it.
        allowed &= rel > -spec.sliding_window
    bias = torch.zeros(rel.shape, dtype=torch.float32, device=rel.device)
    bias = bias.masked_fill(~allowed, float("-inf"))[None]
    if spec.alibi_slopes is not None:
        slopes = torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=rel.device)
        bias = bias + slopes[:, None, None] * rel[None].float()
    return bias


class TorchRefAttention:
    """Reference backend: gathers each request's context and runs dense attention."""

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        spec = self.spec
        write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(query)  # [T, H, D]
        group = spec.num_heads // spec.num_kv_heads
        qsl, seq_lens = attn_metadata.query_start_loc_cpu, attn_metadata.seq_lens_cpu
        for i in range(attn_metadata.num_reqs):
            start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            k, v = gather_context(kv_cache, attn_metadata.block_table[i], seq_len)
            # fp8 caches dequantized: float(stored) * scale.
            k = dequantize_kv(k, k_scale).repeat_interleave(group, dim=1)  # [seq_len, H, D]
            v = dequantize_kv(v, v_scale).repeat_interleave(group, dim=1)
            q = query[start:end].float()  # [q_len, H, D]
            # The chunk's queries sit at the end of the context.
            q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            scores = torch.einsum("qhd,khd->hqk", q, k) * spec.scale
            if spec.logits_soft_cap is not None:
                scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
            scores = scores + attention_bias(spec, q_pos, k_pos)
            probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
        return out
