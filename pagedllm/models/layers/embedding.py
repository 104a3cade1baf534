"""Token embedding and the LM head (optionally tied to it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.linear import cpu_linear, pack_for_cpu
from pagedllm.nn import Module


class VocabEmbedding(Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(Module):
    """hidden [N, hidden] -> logits [N, vocab] in the model's dtype (the sampler converts
    to float32 only when it needs more than the argmax)."""

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(vocab_size), requires_grad=False)
                     if bias else None)

    # Packed copies of `weight` for eager CPU runs (pack_for_cpu; see LinearBase), else
    # None. The plain weight stays: it may be the (tied) embedding table.
    packed_weight: torch.Tensor | None = None
    native_weight: torch.Tensor | None = None
    native_bias: torch.Tensor | None = None

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def pack_for_cpu(self) -> None:
        self.packed_weight, self.native_weight, self.native_bias = pack_for_cpu(self.weight,
                                                                                self.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return cpu_linear(hidden, self.weight, self.bias, self.packed_weight,
                          self.native_weight, self.native_bias)
