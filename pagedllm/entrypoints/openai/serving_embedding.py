"""POST /v1/embeddings: text, texts, token ids or lists of them; float or base64 output.

Every input becomes its own embedding request (PoolingParams: the model's default
pooling, L2-normalized unless `normalize` is false), submitted all or none: a rejected input
fails the whole call (400, or 503 once the engine is gone) and aborts the others.
"""

from __future__ import annotations

import base64

import numpy as np

from pagedllm.entrypoints.openai.embedding_protocol import (EmbeddingData, EmbeddingRequest,
                                                            EmbeddingResponse,
                                                            EmbeddingUsage)
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.serving_common import OpenAIServing
from pagedllm.errors import InvalidRequestError
from pagedllm.pooling_params import PoolingParams

Prompt = tuple[str | None, list[int]]  # (text or None, token ids)

# OpenAI's limit on the inputs of one embeddings call.
MAX_INPUTS = 2048


class OpenAIServingEmbedding(OpenAIServing):

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        self.check_model(request.model)
        if request.dimensions is not None:
            raise InvalidRequestError(
                "dimensions is not supported: this model does not support matryoshka "
                "representation, so the embedding size cannot be changed")
        prompts = await self._parse_inputs(request)
        params = PoolingParams(normalize=request.normalize)
        vectors = await self.pool_all(random_id("embd"), prompts,
                                      [params] * len(prompts), request)
        data = [EmbeddingData(index=i, embedding=_encode(v, request.encoding_format))
                for i, v in enumerate(vectors)]
        num_tokens = sum(len(ids) for _, ids in prompts)
        return EmbeddingResponse(data=data, model=self.response_model(request.model),
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens,
                                                      total_tokens=num_tokens))

    async def _parse_inputs(self, request: EmbeddingRequest) -> list[Prompt]:
        """The inputs as (text, token ids), length-checked; 400 naming `input`."""
        inputs = request.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise InvalidRequestError("input must not be empty")
        if len(inputs) > MAX_INPUTS:
            raise InvalidRequestError(f"input may hold at most {MAX_INPUTS} entries, got "
                                      f"{len(inputs)}")
        return [await self.pooling_prompt(item, request.truncate_prompt_tokens,
                                          f"input[{i}]", request.add_special_tokens)
                for i, item in enumerate(inputs)]


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    """The vector as floats, or (OpenAI's base64) its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding
