"""Pydantic models of vLLM's POST /score (/v1/score) and POST /rerank (/v1/rerank,
/v2/rerank: the Jina and Cohere shape)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, StrictBool, StrictStr, model_validator

from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel, RequestModel
from pagedllm.errors import InvalidRequestError

Texts = StrictStr | list[StrictStr]


class ScoreRequest(RequestModel):
    """text_1 against each text_2 (one text_1), or the two lists pairwise; `queries` /
    `documents` are the same fields under vLLM's newer names."""

    model: str | None = None
    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    truncate_prompt_tokens: int | None = None
    """Cut each input (a cross-encoder's pair: the longer text first) to this many
    tokens; -1: max_model_len."""
    use_activation: StrictBool | None = None
    """A cross-encoder's head activation (False: its logit); None: the model's default."""
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)
    user: str | None = None

    @model_validator(mode="after")
    def _one_naming(self) -> ScoreRequest:
        old = self.text_1 is not None or self.text_2 is not None
        new = self.queries is not None or self.documents is not None
        if old == new:
            raise InvalidRequestError("give text_1 and text_2 (or queries and documents)")
        if old and (self.text_1 is None or self.text_2 is None):
            raise InvalidRequestError("text_1 and text_2 are both required")
        if new and (self.queries is None or self.documents is None):
            raise InvalidRequestError("queries and documents are both required")
        return self

    @property
    def pair_texts(self) -> tuple[str | list[str], str | list[str]]:
        if self.text_1 is not None:
            return self.text_1, self.text_2  # type: ignore[return-value]
        return self.queries, self.documents  # type: ignore[return-value]


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


class _ListResponse(OpenAIBaseModel):
    """What /score and /classify answer around their `data`."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: ScoreUsage


class ScoreResponse(_ListResponse):
    data: list[ScoreData]


class RerankRequest(RequestModel):
    model: str | None = None
    query: StrictStr
    documents: list[StrictStr]
    top_n: int = Field(default=0, ge=0)
    """The best top_n results; 0: all of them."""
    truncate_prompt_tokens: int | None = None
    use_activation: StrictBool | None = None
    return_documents: bool = True
    """Cohere's: False leaves each result's document out."""
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)
    user: str | None = None


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int = 0


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassifyRequest(RequestModel):
    """vLLM's POST /classify: one text or several, each classified on its own."""

    model: str | None = None
    input: StrictStr | list[StrictStr]
    truncate_prompt_tokens: int | None = None
    use_activation: StrictBool | None = None
    """The head's activation (False: the logits); None: the model's default."""
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)
    user: str | None = None


class ClassifyData(OpenAIBaseModel):
    index: int
    label: str
    """The most probable label's name (the config's id2label)."""
    probs: list[float]
    num_classes: int


class ClassifyResponse(_ListResponse):
    data: list[ClassifyData]
