"""Pooler: the embedding of each embedding request, from a step's final hidden states.

An embedding request is scheduled with its whole prompt in one step (core/scheduler.py),
so the step's hidden states hold every position the pooling reads: the last prompt
token ("last"), the first ("cls"), or all of them ("mean"; cls and mean requests take
no prefix-cache hits, so their step starts at position 0). Kept apart from
model_runner.py like prompt_logprobs.py.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedllm.worker.input_batch import InputBatch


def pool_hidden_states(hidden: torch.Tensor, batch: InputBatch, req_ids: list[str],
                       rows: np.ndarray, query_start_loc: np.ndarray,
                       score_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       ) -> dict[str, list[float]] | None:
    """req_id -> pooled vector (float32, L2-normalized when asked) of each embedding
    request of the step; None when the step has none. A score or classify request's
    vector is its pooled state through the model's `score_head` (a cross-encoder's
    score, a classifier's label probabilities).

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
            vec = score_head(vec[None])[0]  # [num_labels]
        elif params.normalize:
            vec = torch.nn.functional.normalize(vec, p=2.0, dim=0)
        vectors.append(vec)
    values = torch.stack(vectors).cpu().tolist()  # one host sync for the step
    return {req_ids[i]: v for i, v in zip(pooled_idx.tolist(), values)}
