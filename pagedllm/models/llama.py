"""Llama family: Llama 1-3, SmolLM, TinyLlama (and Mistral-style configs).

Pre-norm decoder: x += attn(rmsnorm(x)); x += mlp(rmsnorm(x)). q/k/v and gate/up are
fused into single matmuls and filled from HF's separate tensors on load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionSpec
from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.models.layers.activation import SiluAndMul
from pagedllm.models.layers.embedding import LMHead, VocabEmbedding
from pagedllm.models.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear)
from pagedllm.models.layers.norm import RMSNorm
from pagedllm.models.layers.rotary import get_rope
from pagedllm.models.utils import LLAMA_STACKED_PARAMS, load_stacked_weights


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, attn_backend: str, sliding_window: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim,
                                          cfg.num_attention_heads, num_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim,
                                        cfg.hidden_size, bias=bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.rotary_emb = get_rope(cfg, self.head_dim)
        spec = AttentionSpec(num_heads=cfg.num_attention_heads, num_kv_heads=num_kv_heads,
                             head_size=self.head_dim, scale=self.head_dim ** -0.5,
                             sliding_window=sliding_window)
        self.attn = Attention(spec, attn_backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, attn_backend: str, sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, attn_backend, sliding_window)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), attn_metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, attn_backend: str, sliding_window: int | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, attn_backend, sliding_window)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            x = layer(positions, x, attn_metadata)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> float32 logits [N, vocab]."""

    def __init__(self, cfg: Any, attn_backend: str) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, attn_backend, getattr(cfg, "sliding_window", None))
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("rotary_emb.inv_freq",) + (("lm_head.",) if self.tie_word_embeddings else ())
        return load_stacked_weights(self, weights, LLAMA_STACKED_PARAMS, skip=skip)
