"""Scoring pairs of texts (vLLM's LLM.score, /v1/score, /v1/rerank): how the pairs are
formed, how a cross-encoder's pair becomes one prompt, and how an embedding model's two
vectors become one score. The callers (engine/llm.py, entrypoints/openai/serving_score.py)
run the requests.

A cross-encoder (ModelConfig.is_cross_encoder) reads both texts at once: its tokenizer
encodes the pair as one prompt ("[CLS] a [SEP] b [SEP]" for BERT) whose second text is
token type 1 (PoolingParams.token_type_start), and its head turns the pooled [CLS] state
into the score. Any other model that embeds scores a pair by the cosine similarity of the
two texts' (normalized) embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedllm.errors import InvalidRequestError
from pagedllm.pooling_params import PoolingParams


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str],
                ) -> list[tuple[str, str]]:
    """The pairs vLLM scores: one first text against each second text (1 -> N), or the
    two lists zipped (N -> N); InvalidRequestError otherwise."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, texts in (("text_1", first), ("text_2", second)):
        if not texts:
            raise InvalidRequestError(f"{name} must not be empty")
        bad = next((t for t in texts if not isinstance(t, str)), None)
        if bad is not None:
            raise InvalidRequestError(f"{name} must hold strings, got {type(bad).__name__}")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise InvalidRequestError(f"text_1 has {len(first)} texts and text_2 "
                                  f"{len(second)}: give one text_1, or as many as text_2")
    return list(zip(first, second))


def encode_pair(tokenizer: Any, text_1: str, text_2: str, max_model_len: int,
                truncate_prompt_tokens: int | None = None) -> tuple[list[int], int | None]:
    """A cross-encoder's prompt of one pair and where its second text starts (the first
    token of type 1; None when the tokenizer gives no token types: all type 0, as the
    model's own default). `truncate_prompt_tokens` cuts the pair to that many tokens the
    tokenizer's way (the longer text first; -1: max_model_len)."""
    kwargs: dict[str, Any] = {}
    if truncate_prompt_tokens is not None:
        limit = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        kwargs = {"truncation": "longest_first", "max_length": limit}
    encoded = tokenizer(text_1, text_2, **kwargs)
    ids = list(encoded["input_ids"])
    types = encoded.get("token_type_ids")
    start = next((i for i, t in enumerate(types) if t), None) if types is not None else None
    return ids, start


def cross_encoder_params(token_type_start: int | None,
                         use_activation: bool | None = None) -> PoolingParams:
    """The pooling of one cross-encoder pair: its head reads the raw state the model
    pools ([CLS] for an encoder, the last token for a decoder); `use_activation` False
    gives the head's logit."""
    return PoolingParams(task="score", pooling_type=None, use_activation=use_activation,
                         token_type_start=token_type_start)


def classifier_params(truncate_prompt_tokens: int | None = None,
                      use_activation: bool | None = None) -> PoolingParams:
    """The pooling of one text for a classifier: its head reads the raw state the model
    pools; `use_activation` False gives the head's logits."""
    return PoolingParams(task="classify", pooling_type=None, use_activation=use_activation,
                         truncate_prompt_tokens=truncate_prompt_tokens)


def cosine_score(u: Sequence[float], v: Sequence[float]) -> float:
    """The cosine similarity of two embeddings (computed in float64)."""
    a, b = np.asarray(u, dtype=np.float64), np.asarray(v, dtype=np.float64)
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norm if norm else 0.0
