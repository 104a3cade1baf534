"""Gemma 2, and the decoder Gemma 3's text model shares with it (gemma3.py).

What differs from Llama:
- RMSNorm scales by (1 + w), and each layer has four: a sandwich around both blocks,
  x += post_attn_norm(attn(input_norm(x))); x += post_ff_norm(mlp(pre_ff_norm(x))).
- Embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first (HF).
- Gated MLP with GELU's tanh approximation (`hidden_activation`).
- Attention scale query_pre_attn_scalar ** -0.5; attention scores and final logits are
  soft-capped, cap * tanh(x / cap) (attn_logit_softcapping / final_logit_softcapping).
- Layers alternate sliding-window and full attention (`layer_types`).
Gemma 3 adds a per-head q/k RMSNorm (1 + w) and per-layer-type rope parameters
(`rope_parameters[layer_type]`: local base for sliding layers, global for full ones).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.models.layers.embedding import VocabEmbedding
from pagedllm.models.layers.norm import RMSNorm
from pagedllm.models.layers.rotary import RotaryEmbedding, get_rope
from pagedllm.models.llama import (LlamaAttention, LlamaMLP, head_dim_of,
                                   layer_sliding_window, layer_sliding_windows)
from pagedllm.models.pipeline import make_layers, stage_lm_head, stage_part
from pagedllm.models.utils import LLAMA_STACKED_PARAMS, load_stacked_weights


def _rope_for(cfg: Any, head_dim: int, layer_type: str) -> RotaryEmbedding:
    """Gemma 3 nests rope parameters per layer type; Gemma 2 has one flat set."""
    params = getattr(cfg, "rope_parameters", None) or {}
    per_type = isinstance(params.get(layer_type), dict)
    return get_rope(cfg, head_dim, layer_type=layer_type if per_type else None)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(x), attn_metadata)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    """Stage layout under pipeline parallelism as LlamaModel's (models/pipeline.py)."""

    def __init__(self, cfg: Any, attn_backend: str, qk_norm: bool = False,
                 parallel: ParallelState | None = None, keep_embedding: bool = False) -> None:
        super().__init__()
        parallel = self.parallel = parallel or SINGLE_RANK
        self.embed_tokens = stage_part(
            parallel.is_first_stage or keep_embedding,
            lambda: VocabEmbedding(cfg.vocab_size, cfg.hidden_size, parallel))
        self.embed_scale = cfg.hidden_size ** 0.5
        head_dim = head_dim_of(cfg)
        layer_types = cfg.layer_types
        # One cos/sin table per layer type, shared by that type's layers.
        ropes = {t: _rope_for(cfg, head_dim, t) for t in sorted(set(layer_types))}
        soft_cap = getattr(cfg, "attn_logit_softcapping", None)
        self.start_layer, self.end_layer, self.layers = make_layers(
            cfg.num_hidden_layers, lambda i: GemmaDecoderLayer(cfg, LlamaAttention(
                cfg, attn_backend, ropes[layer_types[i]],
                sliding_window=layer_sliding_window(cfg, i),
                qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                qk_norm_offset=1.0 if qk_norm else None,
                scale=cfg.query_pre_attn_scalar ** -0.5, logits_soft_cap=soft_cap,
                parallel=parallel),
                LlamaMLP(cfg, act=cfg.hidden_activation, parallel=parallel)), parallel)
        self.norm = stage_part(parallel.is_last_stage,
                               lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if self.parallel.is_first_stage:
            x = self.embed_tokens(input_ids)  # [T, hidden]
            # sqrt(hidden) as a model-dtype number (HF multiplies by it cast to the
            # weight dtype).
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype).item()
        else:
            x = hidden_states
        for layer in self.layers[self.start_layer:self.end_layer]:
            x = layer(positions, x, attn_metadata)
        return self.norm(x) if self.parallel.is_last_stage else x


class Gemma2ForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> soft-capped logits [N, vocab] (model dtype;
    None on tensor parallel ranks other than 0)."""

    supports_pp = True

    # Each layer's sliding window, for the KV cache groups (worker/kv_layout.py).
    layer_sliding_windows = staticmethod(layer_sliding_windows)

    def __init__(self, cfg: Any, attn_backend: str, qk_norm: bool = False,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        parallel = parallel or SINGLE_RANK
        self.config = cfg
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.model = GemmaModel(cfg, attn_backend, qk_norm, parallel,
                                keep_embedding=(parallel.is_last_stage
                                                and self.tie_word_embeddings))
        self.lm_head = stage_lm_head(
            cfg.vocab_size, cfg.hidden_size, parallel,
            tied_to=self.model.embed_tokens if self.tie_word_embeddings else None)
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata, hidden_states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None or logits is None else cap * torch.tanh(logits / cap)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("rotary_emb.inv_freq",) + (("lm_head.",) if self.tie_word_embeddings else ())
        return load_stacked_weights(self, weights, LLAMA_STACKED_PARAMS, skip=skip)
