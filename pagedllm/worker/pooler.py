"""Pooler: the embedding of each embedding request, from a step's final hidden states.

An embedding request is scheduled with its whole prompt in one step (core/scheduler.py),
so the step's hidden states hold every position the pooling reads: the last prompt
token ("last"), the first ("cls"), or all of them ("mean"; cls and mean requests take
no prefix-cache hits, so their step starts at position 0). Kept apart from
model_runner.py like prompt_logprobs.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.config import PoolerConfig
from pagedllm.worker.input_batch import InputBatch


@dataclass
class ScoreHead:
    """A classification head: the model's logits of pooled states, calibrated by the
    pooler_config (vLLM's Platt scaling), then (when the request uses it) the model's
    activation: activation((logits - mean) / sigma)."""

    logits: Callable[[torch.Tensor], torch.Tensor]
    activation: Callable[[torch.Tensor], torch.Tensor]
    mean: float | None = None
    sigma: float | None = None

    def __call__(self, states: torch.Tensor, use_activation: bool) -> torch.Tensor:
        x = self.logits(states)
        if self.mean is not None:
            x = x - self.mean
        if self.sigma is not None:
            x = x / self.sigma
        return self.activation(x) if use_activation else x


def score_head_of(model: Any, pooler: PoolerConfig) -> ScoreHead | None:
    """The model's classification head (None: it has none, it embeds)."""
    if not hasattr(model, "score_logits"):
        return None
    return ScoreHead(model.score_logits, model.activation, pooler.logit_mean,
                     pooler.logit_sigma)


def pool_hidden_states(hidden: torch.Tensor, batch: InputBatch, req_ids: list[str],
                       rows: np.ndarray, query_start_loc: np.ndarray,
                       score_head: ScoreHead | None = None,
                       ) -> dict[str, list[float]] | None:
    """req_id -> pooled vector (float32) of each embedding request of the step; None
    when the step has none. An embedding keeps its first `dimensions` values and is
    L2-normalized when the request uses the activation. A score or classify request's
    vector is its pooled state through `score_head` (a cross-encoder's score, a
    classifier's label probabilities, or their logits).

    `hidden` is [num_tokens, hidden_size] after the model's final norm, flattened in
    `req_ids` order: request i's tokens are hidden[query_start_loc[i]:query_start_loc[i+1]].
    Each vector is pooled and normalized on its own (no batched reduction), so it does
    not depend on what else the step holds. Loops over the embedding requests only.
    """
    pooled_idx = np.nonzero(batch.is_pooling[rows])[0]
    if len(pooled_idx) == 0:
        return None
    vectors = []
    for i in pooled_idx.tolist():
        params = batch.pooling_params[req_ids[i]]
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if params.pooling_type in ("mean", "cls"):
            # The step starts at position 0 (no cache hits for it).
            assert batch.num_computed_tokens[rows[i]] == 0, req_ids[i]
        if params.pooling_type == "mean":
            vec = hidden[start:end].float().mean(dim=0)  # [H]
        elif params.pooling_type == "cls":
            vec = hidden[start].float()  # [H]: the first prompt token ([CLS])
        else:
            vec = hidden[end - 1].float()  # [H]: the last prompt token
        if params.task in ("score", "classify"):
            assert score_head is not None, "the input processor admits scores only here"
            vec = score_head(vec[None], bool(params.use_activation))[0]  # [num_labels]
        else:
            if params.dimensions is not None:
                vec = vec[:params.dimensions]  # Matryoshka: before normalizing
            if params.use_activation:
                vec = torch.nn.functional.normalize(vec, p=2.0, dim=0)
        vectors.append(vec)
    values = torch.stack(vectors).cpu().tolist()  # one host sync for the step
    return {req_ids[i]: v for i, v in zip(pooled_idx.tolist(), values)}
