"""The Attention module models call: shapes in, shapes out, the backend does the rest."""

from __future__ import annotations

import torch

from pagedllm.attention import forward_context  # noqa: F401 (registers pagedllm::attention)
from pagedllm.attention.backend import AttentionSpec, get_attention_backend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.nn import Module


class Attention(Module):
    """Paged attention over this layer's slice of the KV cache.

    The model runner binds `kv_cache` ([2, num_blocks, block_size, KVH, D]) once after
    allocating the cache; until then the layer cannot run.
    """

    def __init__(self, spec: AttentionSpec, backend: str) -> None:
        super().__init__()
        self.spec = spec
        self.impl = get_attention_backend(backend)(spec)
        self.kv_cache: torch.Tensor | None = None
        # fp8 KV cache scales (attention/kv_quant.py): the cache stores K / k_scale and
        # V / v_scale. Fixed per layer, never derived from traffic (DESIGN.md §10); 1.0 as
        # vLLM without checkpoint scales, which a loader may assign here instead.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # Position among the model's attention layers (set with kv_cache); compiled runs
        # name the layer by it (attention/forward_context.py).
        self.layer_index = -1
        # KV cache group (set with kv_cache): whose block table and slots it uses.
        self.kv_group = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        """q [T, H*D], k/v [T, KVH*D] -> [T, H*D].

        attn_metadata None: a compiled forward; the metadata is in the forward context.
        """
        if attn_metadata is None:
            return torch.ops.pagedllm.attention(q, k, v, self.layer_index)
        return self.attend(q, k, v, attn_metadata)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_metadata: AttentionMetadata) -> torch.Tensor:
        assert self.kv_cache is not None, "KV cache not bound (ModelRunner.initialize_kv_cache)"
        spec = self.spec
        num_tokens = q.shape[0]
        attn_metadata = attn_metadata.for_group(self.kv_group)
        out = self.impl.forward(q.view(num_tokens, spec.num_heads, spec.head_size),
                                k.view(num_tokens, spec.num_kv_heads, spec.head_size),
                                v.view(num_tokens, spec.num_kv_heads, spec.head_size),
                                self.kv_cache, attn_metadata, self.k_scale, self.v_scale)
        return out.reshape(num_tokens, spec.num_heads * spec.head_size)
