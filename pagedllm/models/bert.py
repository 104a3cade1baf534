"""BERT encoder (`BertModel`, as sentence-transformers' all-MiniLM-L6-v2): embeddings; and
the cross-encoder `BertForSequenceClassification` (pair scores) at the end of the file.

x = LayerNorm(word(ids) + position(positions) + token_type(0)); per layer (post-LN):
x = LayerNorm(x + attn(x)); x = LayerNorm(x + W2 gelu(W1 x)). The attention is
bidirectional within each request (attention/encoder.py) and keeps no KV cache; the
model has no LM head: it returns the last layer's hidden states for the pooler
(mean / cls / last). Every prompt is one segment of token type 0 (what an embedding of
one text gets from the tokenizer); a cross-encoder's pair is two.

Checkpoint names are HF's: `embeddings.*`, `encoder.layer.N.*`, with or without the
`bert.` prefix of task checkpoints; the pooler (`pooler.dense`, a tanh head that
sentence-transformers does not use) and old `position_ids` buffers are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.attention.encoder import EncoderAttention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.errors import ModelLoadError
from pagedllm.models.layers.activation import get_act_fn
from pagedllm.models.layers.embedding import VocabEmbedding
from pagedllm.models.layers.linear import (ColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear)
from pagedllm.models.layers.norm import LayerNorm
from pagedllm.models.utils import load_stacked_weights
from pagedllm.nn import Module

# (fused param part, checkpoint part after _hf_names' renames, shard id)
_STACKED_PARAMS = (
    ("qkv_proj", "query", "q"),
    ("qkv_proj", "key", "k"),
    ("qkv_proj", "value", "v"),
)
# Checkpoint entries that are not weights of this model.
_SKIP = ("pooler.", "cls.", "embeddings.position_ids")


class BertEmbeddings(Module):
    def __init__(self, cfg: Any, position_offset: int = 0) -> None:
        super().__init__()
        # RoBERTa numbers positions from padding_idx + 1 (HF's
        # create_position_ids_from_input_ids): its first token reads row pad + 1.
        self.position_offset = position_offset
        hidden = cfg.hidden_size
        self.word_embeddings = VocabEmbedding(cfg.vocab_size, hidden)
        # Learned positions: max_model_len never exceeds max_position_embeddings
        # (engine/arg_utils.py caps it for model_type "bert").
        self.position_embeddings = VocabEmbedding(cfg.max_position_embeddings, hidden)
        self.token_type_embeddings = VocabEmbedding(cfg.type_vocab_size, hidden)
        self.LayerNorm = LayerNorm(hidden, cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.position_offset:
            positions = positions + self.position_offset
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)  # [T, H]
        if token_type_ids is not None:  # a cross-encoder's pair: type 1 on the second
            return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))
        # Token type 0 for every token: row 0, broadcast over the tokens.
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class BertAttention(Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden, num_heads = cfg.hidden_size, cfg.num_attention_heads
        head_dim = hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, bias=True)
        self.q_size = self.qkv_proj.q_size
        self.attn = EncoderAttention(num_heads, head_dim, head_dim ** -0.5)
        self.dense = RowParallelLinear(hidden, hidden, bias=True)
        self.LayerNorm = LayerNorm(hidden, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size] * 3, dim=-1)  # [T, H] each
        return self.LayerNorm(x + self.dense(self.attn(q, k, v, attn_metadata)))


class BertIntermediate(Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.act = get_act_fn(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertOutput(Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dense(x))


class BertLayer(Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = self.attention(x, attn_metadata)
        return self.output(self.intermediate(x), x)


class BertEncoder(Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertModel(nn.Module):
    """forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, hidden]: the
    last encoder layer's output, for the pooler. No LM head (no generation), no KV
    cache, no tensor or pipeline parallelism."""

    def __init__(self, cfg: Any, attn_backend: str) -> None:
        super().__init__()
        # attn_backend: the paged backends do not apply (attention/encoder.py).
        position_type = getattr(cfg, "position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ModelLoadError(f"BERT position_embedding_type {position_type!r} is not "
                                 f"supported (only 'absolute')")
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ModelLoadError(f"hidden_size {cfg.hidden_size} is not a multiple of "
                                 f"num_attention_heads {cfg.num_attention_heads}")
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg, self.position_offset_of(cfg))
        self.encoder = BertEncoder(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)  # [T, hidden]
        for layer in self.encoder.layer:
            x = layer(x, attn_metadata)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_stacked_weights(self, _hf_names(weights), _STACKED_PARAMS, skip=_SKIP)

    @classmethod
    def position_offset_of(cls, cfg: Any) -> int:
        """Rows of the learned position table before position 0 (RoBERTa's pad + 1)."""
        return 0


class RobertaModel(BertModel):
    """RoBERTa / XLM-RoBERTa (bge-m3, multilingual-e5): BERT's layers, one token type,
    and positions counted from padding_idx + 1 (their table has pad + 1 more rows than
    usable positions: arg_utils caps max_model_len by them). Checkpoints name it
    `roberta.*`."""

    @classmethod
    def position_offset_of(cls, cfg: Any) -> int:
        return roberta_position_offset(cfg)


def roberta_position_offset(cfg: Any) -> int:
    pad = getattr(cfg, "pad_token_id", None)
    return (1 if pad is None else pad) + 1


class BertForSequenceClassification(BertModel):
    """With one label a cross-encoder (sentence-transformers' CrossEncoder, e.g.
    ms-marco-MiniLM-L-6-v2): BertModel over the pair "[CLS] a [SEP] b [SEP]", token type
    1 on b (the runner passes `token_type_ids` from each request's
    PoolingParams.token_type_start); with more a classifier of one text. Either way
    `score_logits` reads the [CLS] state: classifier(tanh(pooler.dense(h))), then the
    model's activation (a classifier's: softmax over the labels)."""

    takes_token_type_ids = True

    def __init__(self, cfg: Any, attn_backend: str) -> None:
        super().__init__(cfg, attn_backend)
        hidden = cfg.hidden_size
        self.pooler = BertPooler(cfg)
        self.classifier = ColumnParallelLinear(hidden, cfg.num_labels, bias=True)
        self.activation = head_activation(cfg)

    def score_logits(self, cls_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled [CLS] states -> [N, num_labels] logits (float32), before
        `activation`."""
        x = self.pooler(cls_states.to(self.classifier.weight.dtype))
        return self.classifier(x).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Unlike an embedding model, the pooler is part of the scoring head here.
        return load_stacked_weights(self, _hf_names(weights), _STACKED_PARAMS,
                                    skip=("cls.", "embeddings.position_ids"))


class RobertaForSequenceClassification(RobertaModel):
    """RoBERTa / XLM-RoBERTa with a classification head (bge-reranker-v2-m3 with one
    label: a cross-encoder of "<s> a </s></s> b </s>", one token type): `score_logits`
    is out_proj(tanh(dense(h))) on the <s> state (RobertaClassificationHead; no pooler),
    through the head's activation as for BERT."""

    def __init__(self, cfg: Any, attn_backend: str) -> None:
        super().__init__(cfg, attn_backend)
        self.classifier = RobertaClassificationHead(cfg)
        self.activation = head_activation(cfg)

    def score_logits(self, cls_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled <s> states -> [N, num_labels] logits (float32), before
        `activation`."""
        x = cls_states.to(self.classifier.out_proj.weight.dtype)
        return self.classifier(x).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_stacked_weights(self, _hf_names(weights), _STACKED_PARAMS,
                                    skip=("embeddings.position_ids",))


class RobertaClassificationHead(Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.out_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_labels, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class BertPooler(Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


# sentence-transformers' names of a CrossEncoder's activation, as its config stores them.
_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.Sigmoid": nn.Sigmoid}


def head_activation(cfg: Any) -> nn.Module:
    """A classification head's activation: a cross-encoder's (one label) or a
    classifier's."""
    return cross_encoder_activation(cfg) if cfg.num_labels == 1 else classifier_activation(cfg)


def classifier_activation(cfg: Any) -> nn.Module:
    """Label probabilities as transformers' text-classification pipeline gives them:
    a sigmoid per label for multi-label models, else a softmax over the labels."""
    if getattr(cfg, "problem_type", None) == "multi_label_classification":
        return nn.Sigmoid()
    return nn.Softmax(dim=-1)


def cross_encoder_activation(cfg: Any) -> nn.Module:
    """What turns a cross-encoder's logit into its score, as sentence-transformers'
    CrossEncoder decides: the activation its config names (`sentence_transformers.
    activation_fn`, or the older `sbert_ce_default_activation_function`; ms-marco
    MiniLM names Identity: raw logits), else a sigmoid for one label."""
    st = getattr(cfg, "sentence_transformers", None) or {}
    name = (st.get("activation_fn") if isinstance(st, dict) else None) or getattr(
        cfg, "sbert_ce_default_activation_function", None)
    if name is None:
        return nn.Sigmoid()
    if name not in _ACTIVATIONS:
        raise ModelLoadError(f"cross-encoder activation {name!r} is not supported "
                             f"(supported: {', '.join(sorted(_ACTIVATIONS))})")
    return _ACTIVATIONS[name]()


def _hf_names(weights: Iterable[tuple[str, torch.Tensor]],
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF BERT names -> this module tree's: no `bert.` (`roberta.`) prefix, the self-attention's
    query/key/value and output dense/LayerNorm both directly under `attention.`, and
    the LayerNorm `gamma`/`beta` of TF-era checkpoints as `weight`/`bias`."""
    for name, tensor in weights:
        name = name.removeprefix("bert.").removeprefix("roberta.")
        name = name.replace(".attention.self.", ".attention.")
        name = name.replace(".attention.output.", ".attention.")
        if ".LayerNorm." in name:
            name = name.replace(".gamma", ".weight").replace(".beta", ".bias")
        yield name, tensor
