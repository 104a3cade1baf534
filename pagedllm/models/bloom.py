"""Bloom: ALiBi positions, LayerNorm on the embeddings, tanh-GELU MLP, tied LM head.

- No position embeddings: each head h adds slope_h * (k_pos - q_pos) to its scores (the
  backend's `AttentionSpec.alibi_slopes`). HF adds slope_h * k_pos instead, which differs
  by a per-row constant that softmax cancels.
- `apply_residual_connection_post_layernorm`: the residual is the normed input rather
  than the block input (off in released checkpoints).
- `query_key_value` rows are head-major ([H, 3, D]) as in GPT-NeoX; split on load.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionSpec
from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.models.layers.activation import GeluTanh
from pagedllm.models.layers.embedding import VocabEmbedding
from pagedllm.models.layers.linear import (ColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear)
from pagedllm.models.layers.norm import LayerNorm
from pagedllm.models.pipeline import make_layers, stage_lm_head, stage_part
from pagedllm.models.utils import (QKV_STACKED_PARAMS, load_stacked_weights,
                                   split_interleaved_qkv)


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """ALiBi slopes (Press et al.): for n = 2^k heads, 2^(-8 i / n) for i = 1..n.

    Other head counts take the slopes of the largest power of two n below, then every
    other slope of 2n (odd i) for the remaining heads. Computed in float32 like HF.
    """
    n = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2.0 ** (-8.0 / n), dtype=torch.float32)
    slopes = base ** torch.arange(1, n + 1, dtype=torch.int32)
    if n != num_heads:
        extra_base = torch.tensor(2.0 ** (-4.0 / n), dtype=torch.float32)
        num_extra = min(n, num_heads - n)
        extra = extra_base ** torch.arange(1, 2 * num_extra + 1, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, extra])
    return tuple(slopes.tolist())


class BloomAttention(nn.Module):
    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        hidden, num_heads = cfg.hidden_size, cfg.num_attention_heads
        head_size = hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, head_size, num_heads, num_heads, bias=True,
                                          parallel=parallel)
        self.dense = RowParallelLinear(hidden, hidden, bias=True, parallel=parallel)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # This rank's heads [r * h, (r + 1) * h) keep their slopes.
        local = self.qkv_proj.num_heads
        first = self.qkv_proj.tp_rank * local
        spec = AttentionSpec(num_heads=local, num_kv_heads=local,
                             head_size=head_size, scale=head_size ** -0.5,
                             alibi_slopes=alibi_slopes(num_heads)[first:first + local])
        self.attn = Attention(spec, attn_backend)

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, 3 * hidden]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.dense(self.attn(q, k, v, attn_metadata))


class BloomMLP(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelState | None = None) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.dense_h_to_4h = ColumnParallelLinear(hidden, 4 * hidden, bias=True,
                                                  parallel=parallel)
        self.gelu_impl = GeluTanh()
        self.dense_4h_to_h = RowParallelLinear(4 * hidden, hidden, bias=True,
                                               parallel=parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.gelu_impl(self.dense_h_to_4h(x)))


class BloomBlock(nn.Module):
    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.self_attention = BloomAttention(cfg, attn_backend, parallel)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.mlp = BloomMLP(cfg, parallel)
        self.residual_post_ln = bool(cfg.apply_residual_connection_post_layernorm)

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        normed = self.input_layernorm(x)
        x = (normed if self.residual_post_ln else x) + self.self_attention(normed,
                                                                           attn_metadata)
        normed = self.post_attention_layernorm(x)
        return (normed if self.residual_post_ln else x) + self.mlp(normed)


class BloomModel(nn.Module):
    """Stage layout under pipeline parallelism as LlamaModel's (models/pipeline.py); the
    embedding LayerNorm belongs to the first stage. ALiBi slopes depend on the head only,
    so a stage's layers keep theirs whatever its layer range."""

    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None, keep_embedding: bool = False) -> None:
        super().__init__()
        parallel = self.parallel = parallel or SINGLE_RANK
        eps = cfg.layer_norm_epsilon
        self.word_embeddings = stage_part(
            parallel.is_first_stage or keep_embedding,
            lambda: VocabEmbedding(cfg.vocab_size, cfg.hidden_size, parallel))
        self.word_embeddings_layernorm = stage_part(
            parallel.is_first_stage, lambda: LayerNorm(cfg.hidden_size, eps))
        self.start_layer, self.end_layer, self.h = make_layers(
            cfg.num_hidden_layers, lambda i: BloomBlock(cfg, attn_backend, parallel), parallel)
        self.ln_f = stage_part(parallel.is_last_stage, lambda: LayerNorm(cfg.hidden_size, eps))

    def forward(self, input_ids: torch.Tensor, attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if self.parallel.is_first_stage:
            x = self.word_embeddings_layernorm(self.word_embeddings(input_ids))  # [T, hidden]
        else:
            x = hidden_states
        for block in self.h[self.start_layer:self.end_layer]:
            x = block(x, attn_metadata)
        return self.ln_f(x) if self.parallel.is_last_stage else x


class BloomForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> logits [N, vocab] (model dtype). Positions are
    unused: ALiBi reads them from the attention metadata's sequence layout. Under TP the
    logits are None on ranks other than 0."""

    # Pipeline parallelism: forward takes the previous stage's hidden states.
    supports_pp = True

    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        parallel = parallel or SINGLE_RANK
        self.config = cfg
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.transformer = BloomModel(cfg, attn_backend, parallel,
                                      keep_embedding=(parallel.is_last_stage
                                                      and self.tie_word_embeddings))
        self.lm_head = stage_lm_head(
            cfg.vocab_size, cfg.hidden_size, parallel,
            tied_to=self.transformer.word_embeddings if self.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        return self.transformer(input_ids, attn_metadata, hidden_states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("lm_head.",) if self.tie_word_embeddings else ()
        cfg = self.config
        split = _split_qkv(weights, cfg.num_attention_heads,
                           cfg.hidden_size // cfg.num_attention_heads)
        return load_stacked_weights(self, split, QKV_STACKED_PARAMS, skip=skip)


def _split_qkv(weights: Iterable[tuple[str, torch.Tensor]], num_heads: int, head_size: int,
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """Add the "transformer." prefix bigscience checkpoints lack; split the head-major
    `query_key_value` tensors into q/k/v_proj ones."""
    for name, tensor in weights:
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        if ".query_key_value." not in name:
            yield name, tensor
            continue
        parts = split_interleaved_qkv(tensor, num_heads, head_size)
        for part, t in zip(("q_proj", "k_proj", "v_proj"), parts):
            yield name.replace(".query_key_value.", f".{part}."), t
