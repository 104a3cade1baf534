"""Bidirectional self-attention of encoder models (BERT), with no KV cache.

An encoder's prompt is computed whole in one step: embedding requests are never chunked
(core/scheduler.py) and an encoder model takes no prefix-cache hits (prefix caching is
off for it, engine/arg_utils.py), so every key a query attends to is among this step's
own tokens and nothing needs to be cached for a later step. Each request attends only
within its own segment of the flattened batch, so its output does not depend on what
else the step holds. Not a paged `Attention` layer: worker/memory.py finds no layer to
size a cache for and the engine keeps only block-id bookkeeping for such a model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.nn import Module


class EncoderAttention(Module):
    """q, k, v [T, H*D] of a step's flattened requests -> [T, H*D], request i's queries
    attending to all (and only) request i's keys (no causal mask)."""

    def __init__(self, num_heads: int, head_size: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        if attn_metadata is None:
            raise RuntimeError("encoder attention needs the step's attention metadata "
                               "(compiled runs are not supported for encoder models)")
        starts = attn_metadata.query_start_loc_cpu
        out = torch.empty_like(q)  # [T, H*D]
        for i in range(attn_metadata.num_reqs):
            start, end = int(starts[i]), int(starts[i + 1])
            # The whole sequence is in this step: no context before it (prefix hits,
            # earlier chunks) that a cache would have to hold.
            assert attn_metadata.seq_lens_cpu[i] == end - start, "encoder prompt split"
            o = F.scaled_dot_product_attention(
                self._heads(q[start:end]), self._heads(k[start:end]),
                self._heads(v[start:end]), is_causal=False, scale=self.scale)  # [H, L, D]
            out[start:end] = o.transpose(0, 1).reshape(end - start, -1)
        return out

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[L, H*D] -> [H, L, D]."""
        return x.view(x.shape[0], self.num_heads, self.head_size).transpose(0, 1)
