"""POST /v1/embeddings: text, texts, token ids or lists of them; float or base64 output.
POST /pooling (vLLM's): the same inputs, each one's output of the model's pooling task.

Every input becomes its own embedding request (PoolingParams: the model's default
pooling, L2-normalized unless `normalize` is false), submitted all or none: a rejected input
fails the whole call (400, or 503 once the engine is gone) and aborts the others.
"""

from __future__ import annotations

import base64

import numpy as np

from pagedllm.engine.scoring import classifier_params, cross_encoder_params
from pagedllm.entrypoints.openai.embedding_protocol import (EmbeddingData, EmbeddingRequest,
                                                            EmbeddingResponse,
                                                            EmbeddingUsage, PoolingData,
                                                            PoolingRequest, PoolingResponse)
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.serving_common import OpenAIServing
from pagedllm.errors import InvalidRequestError
from pagedllm.pooling_params import PoolingParams

Prompt = tuple[str | None, list[int]]  # (text or None, token ids)

# OpenAI's limit on the inputs of one embeddings call.
MAX_INPUTS = 2048


class OpenAIServingEmbedding(OpenAIServing):

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        if request.dimensions is not None:
            raise InvalidRequestError(
                "dimensions is not supported: this model does not support matryoshka "
                "representation, so the embedding size cannot be changed")
        outputs, usage = await self._pool(request, "embd",
                                          PoolingParams(normalize=request.normalize))
        return EmbeddingResponse(data=[EmbeddingData(index=i, embedding=out)
                                       for i, out in enumerate(outputs)],
                                 model=self.response_model(request.model), usage=usage)

    async def create_pooling(self, request: PoolingRequest) -> PoolingResponse:
        """vLLM's /pooling: each input's pooled output (LLM.encode's), as the task reads
        it: the embedding, a classifier's probabilities or a cross-encoder's score."""
        if request.dimensions is not None:
            raise InvalidRequestError("dimensions is not supported by /pooling")
        task = request.task or self.engine.config.model.pooling_task
        params = {"embed": PoolingParams(normalize=request.normalize),
                  "classify": classifier_params(), "score": cross_encoder_params(None)}[task]
        outputs, usage = await self._pool(request, "pool", params)
        return PoolingResponse(data=[PoolingData(index=i, data=out)
                                     for i, out in enumerate(outputs)],
                               model=self.response_model(request.model), usage=usage)

    async def _pool(self, request: EmbeddingRequest, id_prefix: str, params: PoolingParams,
                    ) -> tuple[list[list[float] | str], EmbeddingUsage]:
        """Every input pooled with `params`, all or none: the outputs in the request's
        encoding_format, and the usage."""
        self.check_model(request.model)
        prompts = await self._parse_inputs(request)
        vectors = await self.pool_all(random_id(id_prefix), prompts,
                                      [params] * len(prompts), request)
        num_tokens = sum(len(ids) for _, ids in prompts)
        return ([_encode(v, request.encoding_format) for v in vectors],
                EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))

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
