"""GPT-NeoX (Pythia, GPT-NeoX-20B, ...): partial rotary, optionally parallel residual.

- Rotary covers the first `partial_rotary_factor` (transformers < 5: `rotary_pct`) of each
  head's dims, rotating halves (NeoX style); the rest pass through unchanged.
- `use_parallel_residual`: x + attn(ln1(x)) + mlp(ln2(x)); otherwise the usual sequential
  pre-norm block: x += attn(ln1(x)); x += mlp(ln2(x)).
- `query_key_value` rows are head-major ([H, 3, D]); they are split into q/k/v shards on
  load so `qkv_proj` holds [q | k | v] like every other model.
- The LM head is a separate `embed_out` matrix (untied by default).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionSpec
from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.models.layers.activation import get_act_fn
from pagedllm.models.layers.embedding import VocabEmbedding
from pagedllm.models.layers.linear import (ColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear)
from pagedllm.models.layers.norm import LayerNorm
from pagedllm.models.layers.rotary import get_rope
from pagedllm.models.pipeline import make_layers, stage_lm_head, stage_part
from pagedllm.models.utils import (QKV_STACKED_PARAMS, load_stacked_weights,
                                   split_interleaved_qkv)

# Buffers older checkpoints carry (causal masks, rotary tables); not weights.
_BUFFERS = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")


def partial_rotary_factor(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor", getattr(cfg, "rotary_pct", 1.0)))


class GPTNeoXAttention(nn.Module):
    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        hidden, num_heads = cfg.hidden_size, cfg.num_attention_heads
        self.head_size = hidden // num_heads
        bias = getattr(cfg, "attention_bias", True)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, num_heads, num_heads,
                                          bias=bias, parallel=parallel)
        self.dense = RowParallelLinear(hidden, hidden, bias=bias, parallel=parallel)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        rotary_dim = int(self.head_size * partial_rotary_factor(cfg))
        self.rotary_emb = get_rope(cfg, self.head_size, rotary_dim=rotary_dim,
                                   is_neox_style=True)
        local_heads = self.qkv_proj.num_heads  # this rank's share
        spec = AttentionSpec(num_heads=local_heads, num_kv_heads=local_heads,
                             head_size=self.head_size, scale=self.head_size ** -0.5)
        self.attn = Attention(spec, attn_backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, 3 * hidden]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.dense(self.attn(q, k, v, attn_metadata))


class GPTNeoXMLP(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size,
                                                  bias=True, parallel=parallel)
        self.act = get_act_fn(cfg.hidden_act)
        self.dense_4h_to_h = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                               bias=True, parallel=parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.use_parallel_residual = cfg.use_parallel_residual
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.attention = GPTNeoXAttention(cfg, attn_backend, parallel)
        self.mlp = GPTNeoXMLP(cfg, parallel)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        attn_out = self.attention(positions, self.input_layernorm(x), attn_metadata)
        if self.use_parallel_residual:
            # Both branches read the block input x.
            return x + attn_out + self.mlp(self.post_attention_layernorm(x))
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTNeoXModel(nn.Module):
    """Stage layout under pipeline parallelism as LlamaModel's (models/pipeline.py)."""

    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None, keep_embedding: bool = False) -> None:
        super().__init__()
        parallel = self.parallel = parallel or SINGLE_RANK
        self.embed_in = stage_part(
            parallel.is_first_stage or keep_embedding,
            lambda: VocabEmbedding(cfg.vocab_size, cfg.hidden_size, parallel))
        self.start_layer, self.end_layer, self.layers = make_layers(
            cfg.num_hidden_layers, lambda i: GPTNeoXLayer(cfg, attn_backend, parallel),
            parallel)
        self.final_layer_norm = stage_part(
            parallel.is_last_stage, lambda: LayerNorm(cfg.hidden_size, cfg.layer_norm_eps))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if self.parallel.is_first_stage:
            x = self.embed_in(input_ids)  # [T, hidden]
        else:
            x = hidden_states
        for layer in self.layers[self.start_layer:self.end_layer]:
            x = layer(positions, x, attn_metadata)
        return self.final_layer_norm(x) if self.parallel.is_last_stage else x


class GPTNeoXForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> logits [N, vocab] (model dtype; None on tensor
    parallel ranks other than 0)."""

    # Pipeline parallelism: forward takes the previous stage's hidden states.
    supports_pp = True

    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        parallel = parallel or SINGLE_RANK
        self.config = cfg
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.gpt_neox = GPTNeoXModel(cfg, attn_backend, parallel,
                                     keep_embedding=(parallel.is_last_stage
                                                     and self.tie_word_embeddings))
        self.embed_out = stage_lm_head(
            cfg.vocab_size, cfg.hidden_size, parallel,
            tied_to=self.gpt_neox.embed_in if self.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        return self.gpt_neox(input_ids, positions, attn_metadata, hidden_states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.embed_out(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("embed_out.", "lm_head.") if self.tie_word_embeddings else ()
        cfg = self.config
        split = _split_qkv(weights, cfg.num_attention_heads,
                           cfg.hidden_size // cfg.num_attention_heads)
        # transformers 5 calls the head lm_head in memory but saves it as embed_out.
        return load_stacked_weights(self, split, QKV_STACKED_PARAMS, skip=skip,
                                    rename={"lm_head.": "embed_out."})


def _split_qkv(weights: Iterable[tuple[str, torch.Tensor]], num_heads: int, head_size: int,
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """Drop buffers; split head-major `query_key_value` tensors into q/k/v_proj ones."""
    for name, tensor in weights:
        if name.endswith(_BUFFERS):
            continue
        if ".query_key_value." not in name:
            yield name, tensor
            continue
        parts = split_interleaved_qkv(tensor, num_heads, head_size)
        for part, t in zip(("q_proj", "k_proj", "v_proj"), parts):
            yield name.replace(".query_key_value.", f".{part}."), t
