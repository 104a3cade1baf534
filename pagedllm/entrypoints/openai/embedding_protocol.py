"""Pydantic models of POST /v1/embeddings (OpenAI's fields, vLLM's extras) and of vLLM's
POST /pooling (the same inputs; each one's pooled output, whatever the model's task)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, StrictInt, StrictStr

from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel, RequestModel, random_id


class EmbeddingRequest(RequestModel):
    """OpenAI's embeddings body. Each input is embedded as its own engine request."""

    model: str | None = None
    # Text, texts, token ids, or lists of token ids (strict: no coercion of 1 <-> "1").
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka truncation: refused unless None (the handler says so).
    dimensions: int | None = None
    user: str | None = None
    # vLLM extras
    add_special_tokens: bool = True
    normalize: bool = True
    truncate_prompt_tokens: int | None = None
    """Embed each input's last k tokens (-1: max_model_len), before the length check."""
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # Floats, or base64 of their little-endian float32 bytes.
    embedding: list[float] | str


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling body: the embeddings fields and the pooling task."""

    task: Literal["embed", "classify", "score"] | None = None
    """"embed" (the embedding), "classify" (a classifier's label probabilities), "score"
    (a cross-encoder's score of the input as one text); None: the model's own."""


class PoolingData(OpenAIBaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | str


class PoolingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: EmbeddingUsage
