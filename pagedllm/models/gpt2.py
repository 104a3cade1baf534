"""GPT-2: learned absolute positions, pre-LayerNorm blocks, GELU MLP, tied LM head.

x = wte(ids) + wpe(positions); per block x += attn(ln_1(x)); x += mlp(ln_2(x)); ln_f.
Checkpoints store every projection as a transformers `Conv1D` ([in, out], the transpose of
nn.Linear's [out, in]) and q/k/v fused as `c_attn` [in, 3 * hidden] in q | k | v order:
loading transposes them and feeds c_attn's thirds to `qkv_proj` as its q/k/v shards.
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
from pagedllm.models.pipeline import make_layers, stage_lm_head, stage_part
from pagedllm.models.utils import QKV_STACKED_PARAMS, load_stacked_weights

# Checkpoint modules stored as Conv1D ([in, out]).
_CONV1D = ("c_attn", "c_proj", "c_fc")
# Causal-mask buffers some old checkpoints carry; not weights.
_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: Any, attn_backend: str, layer_idx: int,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        hidden, num_heads = cfg.hidden_size, cfg.num_attention_heads
        head_dim = hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, bias=True,
                                          parallel=parallel)
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True, parallel=parallel)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        scale = head_dim ** -0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        # reorder_and_upcast_attn only changes HF's eager precision; scores here are
        # computed by the backend (float32 in torch_ref), so it needs no switch.
        local_heads = self.qkv_proj.num_heads  # this rank's share
        spec = AttentionSpec(num_heads=local_heads, num_kv_heads=local_heads,
                             head_size=head_dim, scale=scale)
        self.attn = Attention(spec, attn_backend)

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, 3 * hidden]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.c_proj(self.attn(q, k, v, attn_metadata))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelState | None = None) -> None:
        super().__init__()
        inner = getattr(cfg, "n_inner", None) or 4 * cfg.hidden_size
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, inner, bias=True, parallel=parallel)
        self.act = get_act_fn(cfg.activation_function)
        self.c_proj = RowParallelLinear(inner, cfg.hidden_size, bias=True, parallel=parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: Any, attn_backend: str, layer_idx: int,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_1 = LayerNorm(cfg.hidden_size, eps)
        self.attn = GPT2Attention(cfg, attn_backend, layer_idx, parallel)
        self.ln_2 = LayerNorm(cfg.hidden_size, eps)
        self.mlp = GPT2MLP(cfg, parallel)

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_metadata)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """Stage layout under pipeline parallelism as LlamaModel's (models/pipeline.py); the
    learned positions are part of the embedding, so only the first stage holds them."""

    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None, keep_embedding: bool = False) -> None:
        super().__init__()
        parallel = self.parallel = parallel or SINGLE_RANK
        self.wte = stage_part(
            parallel.is_first_stage or keep_embedding,
            lambda: VocabEmbedding(cfg.vocab_size, cfg.hidden_size, parallel))
        # Learned positions: max_model_len never exceeds n_positions (config.py caps it).
        # Replicated on every TP rank of the first stage (a position table is small).
        self.wpe = stage_part(parallel.is_first_stage, lambda: VocabEmbedding(
            cfg.max_position_embeddings, cfg.hidden_size))
        # Global layer indices: scale_attn_by_inverse_layer_idx reads them.
        self.start_layer, self.end_layer, self.h = make_layers(
            cfg.num_hidden_layers, lambda i: GPT2Block(cfg, attn_backend, i, parallel),
            parallel)
        self.ln_f = stage_part(parallel.is_last_stage,
                               lambda: LayerNorm(cfg.hidden_size, cfg.layer_norm_epsilon))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if self.parallel.is_first_stage:
            x = self.wte(input_ids) + self.wpe(positions)  # [T, hidden]
        else:
            x = hidden_states
        for block in self.h[self.start_layer:self.end_layer]:
            x = block(x, attn_metadata)
        return self.ln_f(x) if self.parallel.is_last_stage else x


class GPT2LMHeadModel(nn.Module):
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
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.transformer = GPT2Model(cfg, attn_backend, parallel,
                                     keep_embedding=(parallel.is_last_stage
                                                     and self.tie_word_embeddings))
        self.lm_head = stage_lm_head(
            cfg.vocab_size, cfg.hidden_size, parallel,
            tied_to=self.transformer.wte if self.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        return self.transformer(input_ids, positions, attn_metadata, hidden_states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("lm_head.",) if self.tie_word_embeddings else ()
        return load_stacked_weights(self, _as_linear_weights(weights), QKV_STACKED_PARAMS,
                                    skip=skip)


def _as_linear_weights(weights: Iterable[tuple[str, torch.Tensor]],
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF GPT-2 names/tensors -> nn.Linear-shaped tensors, c_attn split into q/k/v_proj."""
    for name, tensor in weights:
        if name.endswith(_BUFFERS):
            continue
        if not name.startswith(("transformer.", "lm_head.")):
            # The original openai-community checkpoints carry no "transformer." prefix.
            name = "transformer." + name
        module = name.rsplit(".", 2)[-2]
        if module in _CONV1D and name.endswith(".weight"):
            tensor = tensor.t()  # Conv1D [in, out] -> Linear [out, in]
        if module == "c_attn":
            # Rows (after the transpose) are [q | k | v], each hidden wide.
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                yield name.replace(".c_attn.", f".{part}."), chunk
            continue
        yield name, tensor
