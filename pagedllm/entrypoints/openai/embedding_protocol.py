"""Pydantic models of POST /v1/embeddings (OpenAI's fields, vLLM's extras) and of vLLM's
POST /pooling (the same inputs; each one's pooled output, whatever the model's task)."""

from __future__ import annotations

import builtins
import time
from typing import Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel, RequestModel, random_id


class EmbeddingRequest(RequestModel):
    """OpenAI's embeddings body. Each input is embedded as its own engine request."""

    model: str | None = None
    # Text, texts, token ids, or lists of token ids (strict: no coercion of 1 <-> "1").
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    """Matryoshka models: the embedding's first `dimensions` values (normalized after)."""
    user: str | None = None
    # vLLM extras
    add_special_tokens: bool = True
    use_activation: StrictBool | None = None
    """L2-normalize (None: the model's default, on unless --pooler-config says off)."""
    normalize: StrictBool | None = None
    """Older vLLM's name of use_activation."""
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


class CohereEmbedRequest(RequestModel):
    """Cohere's POST /v2/embed body (as vLLM serves it): texts, each embedded as its own
    engine request. Images and mixed `inputs` are refused by name (this server embeds
    texts)."""

    model: str | None = None
    texts: list[StrictStr] | None = None
    images: list[StrictStr] | None = None
    inputs: list[dict] | None = None
    input_type: str | None = None
    """A kind of input the model's sentence-transformers prompts name (search_query,
    search_document, ...): that prompt goes before each text."""
    embedding_types: list[Literal["float", "binary", "ubinary", "base64"]] | None = None
    """Default ["float"]."""
    output_dimension: int | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    """Past max_tokens (default: the context): END drops the text's end, START its
    start, NONE refuses it."""
    max_tokens: int | None = Field(default=None, ge=1)
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)


class CohereEmbeddings(OpenAIBaseModel):
    # (builtins.float: the field's name shadows the type in the class body)
    float: list[list[builtins.float]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None


class CohereApiVersion(OpenAIBaseModel):
    version: str = "2"


class CohereBilledUnits(OpenAIBaseModel):
    input_tokens: int


class CohereMeta(OpenAIBaseModel):
    api_version: CohereApiVersion = Field(default_factory=CohereApiVersion)
    billed_units: CohereBilledUnits


class CohereEmbedResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    embeddings: CohereEmbeddings
    texts: list[str]
    meta: CohereMeta
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"
