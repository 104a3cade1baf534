"""OPT: learned positions (offset 2), ReLU MLP, pre- or post-LayerNorm blocks.

- `do_layer_norm_before` (all sizes but 350m): x += attn(ln(x)); x += mlp(ln(x)), then a
  final LayerNorm. Otherwise (opt-350m): x = ln(x + attn(x)); x = ln(x + mlp(x)), and no
  final LayerNorm.
- `word_embed_proj_dim != hidden_size` (opt-350m): token embeddings and the LM head live
  in the smaller dim; `project_in` / `project_out` map to and from the hidden size.
- Position p reads row p + 2 of `embed_positions` (fairseq reserved rows 0 and 1).
q/k/v are separate in the checkpoint and fused into `qkv_proj` on load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionSpec
from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.models.layers.activation import get_act_fn
from pagedllm.models.layers.embedding import VocabEmbedding
from pagedllm.models.layers.linear import (ColumnParallelLinear, LinearBase,
                                           QKVParallelLinear, RowParallelLinear)
from pagedllm.models.layers.norm import LayerNorm
from pagedllm.models.pipeline import make_layers, stage_lm_head, stage_part
from pagedllm.models.utils import QKV_STACKED_PARAMS, load_stacked_weights

# Rows 0 and 1 of embed_positions are never read by position ids >= 0.
POSITION_OFFSET = 2


def _layer_norm(cfg: Any) -> LayerNorm:
    return LayerNorm(cfg.hidden_size, 1e-5,
                     elementwise_affine=getattr(cfg, "layer_norm_elementwise_affine", True))


class OPTAttention(nn.Module):
    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        hidden, num_heads = cfg.hidden_size, cfg.num_attention_heads
        head_dim = hidden // num_heads
        bias = getattr(cfg, "enable_bias", True)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, bias=bias,
                                          parallel=parallel)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias, parallel=parallel)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # HF scales q by head_dim ** -0.5 before q k^T; the backend's scale is the same.
        local_heads = self.qkv_proj.num_heads  # this rank's share
        spec = AttentionSpec(num_heads=local_heads, num_kv_heads=local_heads,
                             head_size=head_dim, scale=head_dim ** -0.5)
        self.attn = Attention(spec, attn_backend)

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, 3 * hidden]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.out_proj(self.attn(q, k, v, attn_metadata))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        bias = getattr(cfg, "enable_bias", True)
        self.do_layer_norm_before = cfg.do_layer_norm_before
        self.self_attn = OPTAttention(cfg, attn_backend, parallel)
        self.self_attn_layer_norm = _layer_norm(cfg)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_dim, bias=bias,
                                        parallel=parallel)
        self.activation_fn = get_act_fn(cfg.activation_function)
        self.fc2 = RowParallelLinear(cfg.ffn_dim, cfg.hidden_size, bias=bias,
                                     parallel=parallel)
        self.final_layer_norm = _layer_norm(cfg)

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        pre = self.do_layer_norm_before
        h = self.self_attn_layer_norm(x) if pre else x
        x = x + self.self_attn(h, attn_metadata)
        if not pre:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if pre else x
        x = x + self.fc2(self.activation_fn(self.fc1(h)))
        return x if pre else self.final_layer_norm(x)


class OPTDecoder(nn.Module):
    """Under TP the token embedding is vocab-parallel; positions and the (small)
    project_in / project_out maps are replicated on every TP rank of their stage.

    Stage layout under pipeline parallelism as LlamaModel's (models/pipeline.py): the first
    stage embeds (tokens, project_in, positions), the last applies the final LayerNorm and
    project_out, so the hidden states between stages are always hidden_size wide."""

    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None, keep_embedding: bool = False) -> None:
        super().__init__()
        parallel = self.parallel = parallel or SINGLE_RANK
        first, last = parallel.is_first_stage, parallel.is_last_stage
        hidden, proj_dim = cfg.hidden_size, cfg.word_embed_proj_dim or cfg.hidden_size
        self.embed_tokens = stage_part(
            first or keep_embedding,
            lambda: VocabEmbedding(cfg.vocab_size, proj_dim, parallel))
        self.embed_positions = stage_part(first, lambda: VocabEmbedding(
            cfg.max_position_embeddings + POSITION_OFFSET, hidden))
        self.project_in = self.project_out = None
        if proj_dim != hidden:
            self.project_in = stage_part(
                first, lambda: LinearBase(proj_dim, hidden, bias=False))
            self.project_out = stage_part(
                last, lambda: LinearBase(hidden, proj_dim, bias=False))
        self.final_layer_norm = None
        if cfg.do_layer_norm_before and not getattr(cfg, "_remove_final_layer_norm", False):
            self.final_layer_norm = stage_part(last, lambda: _layer_norm(cfg))
        self.start_layer, self.end_layer, self.layers = make_layers(
            cfg.num_hidden_layers, lambda i: OPTDecoderLayer(cfg, attn_backend, parallel),
            parallel)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if self.parallel.is_first_stage:
            x = self._embed(input_ids, positions)  # [T, hidden]
        else:
            x = hidden_states
        for layer in self.layers[self.start_layer:self.end_layer]:
            x = layer(x, attn_metadata)
        return self._finish(x) if self.parallel.is_last_stage else x

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, word_embed_proj_dim]
        if self.project_in is not None:
            x = self.project_in(x)  # [T, hidden]
        return x + self.embed_positions(positions + POSITION_OFFSET)

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)  # [T, word_embed_proj_dim]
        return x


class OPTModel(nn.Module):
    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None, keep_embedding: bool = False) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg, attn_backend, parallel, keep_embedding)


class OPTForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, word_embed_proj_dim];
    compute_logits(hidden [N, word_embed_proj_dim]) -> logits [N, vocab] (model dtype;
    None on tensor parallel ranks other than 0)."""

    # Pipeline parallelism: forward takes the previous stage's hidden states.
    supports_pp = True

    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        parallel = parallel or SINGLE_RANK
        self.config = cfg
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.model = OPTModel(cfg, attn_backend, parallel,
                              keep_embedding=(parallel.is_last_stage
                                              and self.tie_word_embeddings))
        self.lm_head = stage_lm_head(
            cfg.vocab_size, cfg.word_embed_proj_dim or cfg.hidden_size, parallel,
            tied_to=self.model.decoder.embed_tokens if self.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, attn_metadata, hidden_states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("lm_head.",) if self.tie_word_embeddings else ()
        # facebook/opt-* checkpoints name the decoder without the "model." prefix.
        return load_stacked_weights(self, weights, QKV_STACKED_PARAMS, skip=skip,
                                    rename={"decoder.": "model.decoder."})
