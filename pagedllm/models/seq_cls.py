"""Decoders with a classification head instead of an LM head (transformers'
`LlamaForSequenceClassification` and kin): rerankers and reward models with one label
(bge-reranker-v2-gemma's kind, Skywork-Reward), classifiers with several.

The head is `score`, a bias-free linear [num_labels, hidden] on the last prompt token's
(normed) hidden state, as transformers reads it for an unpadded prompt; its activation
is the BERT heads' (models/bert.py: a cross-encoder's sigmoid or its
sentence-transformers activation with one label, a softmax or per-label sigmoid with
several). The decoder runs as for generation (KV cache, prefix caching, tensor and
pipeline parallelism); the head is whole on every rank, which all hold the whole
hidden state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.distributed.parallel_state import ParallelState
from pagedllm.errors import ModelLoadError
from pagedllm.kernels.cpu.quant import QuantizedWeight
from pagedllm.models.bert import head_activation
from pagedllm.models.layers.linear import ColumnParallelLinear
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM


class SequenceClassifierMixin:
    """Before a Llama-shaped decoder class in the bases: no LM head, a `score` head."""

    has_lm_head = False

    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__(cfg, attn_backend, parallel=parallel)  # type: ignore[call-arg]
        self.score = ColumnParallelLinear(cfg.hidden_size, cfg.num_labels, bias=False)
        self.activation = head_activation(cfg)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """A classifier checkpoint's weights; or, for a causal LM read as a classifier
        (config `classifier_token_ids`, set from vLLM's hf_overrides
        `classifier_from_token`), its LM head's rows of those tokens as the score head
        (two tokens: the second's row minus the first's), the rest of the head
        skipped."""
        token_ids = getattr(self.config, "classifier_token_ids", None)
        if token_ids is None:
            return super().load_weights(weights)
        # A tied head is the embedding: its rows are read as it is loaded.
        head = "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"

        def with_score() -> Iterator[tuple[str, torch.Tensor]]:
            score = None
            for name, tensor in weights:
                if name == head:
                    full = (tensor.dequantize(torch.float32)
                            if isinstance(tensor, QuantizedWeight) else tensor)
                    rows = full[token_ids].float()
                    score = rows[1:] - rows[:1] if len(token_ids) == 2 else rows
                if name != "lm_head.weight":
                    yield name, tensor
            if score is None:
                raise ModelLoadError(f"classifier_from_token needs the LM head ({head}), "
                                     f"which the checkpoint lacks")
            yield "score.weight", score

        return super().load_weights(with_score())

    def score_logits(self, states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled last-token states -> [N, num_labels] logits (float32),
        before `activation`."""
        return self.score(states.to(self.score.weight.dtype)).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError("a sequence classifier has no LM head: it only scores")


class LlamaForSequenceClassification(SequenceClassifierMixin, LlamaForCausalLM):
    pass


class Qwen2ForSequenceClassification(SequenceClassifierMixin, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(SequenceClassifierMixin, Qwen3ForCausalLM):
    pass
