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
from pagedllm.entrypoints.openai.serving_common import (OpenAIServing, RequestTimeoutError,
                                                        merge_streams)
from pagedllm.errors import InvalidRequestError
from pagedllm.outputs import EmbeddingRequestOutput
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
        request_id = random_id("embd")
        streams = self.add_requests(request_id, prompts, [params] * len(prompts), request)
        finals: list[EmbeddingRequestOutput | None] = [None] * len(prompts)
        try:
            async for i, out in merge_streams(streams):
                finals[i] = out
        finally:
            self.abort_all(request_id, len(prompts))  # no-op unless one failed
        data = []
        for i, out in enumerate(finals):
            assert out is not None and out.finished, "every stream ends finished"
            if out.finish_reason != "stop":
                raise RequestTimeoutError(f"The embedding request ended without a result "
                                          f"({out.finish_reason}).")
            data.append(EmbeddingData(index=i, embedding=_encode(out.outputs.embedding,
                                                                 request.encoding_format)))
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
        prompts: list[Prompt] = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                ids = await self.encode(item, request.add_special_tokens) if item else []
                prompts.append(self.truncate(item, ids, request.truncate_prompt_tokens))
            else:
                prompts.append(self.truncate(None, list(item), request.truncate_prompt_tokens))
            self._check_input_length(len(prompts[-1][1]), i)
        return prompts

    def _check_input_length(self, num_tokens: int, index: int) -> None:
        where = f"input[{index}]"
        if num_tokens == 0:
            raise InvalidRequestError(f"{where} is empty: give at least one token")
        if num_tokens > self.max_model_len:
            # vLLM's message for embedding inputs.
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_tokens} tokens in the input for embedding "
                f"generation ({where}). Please reduce the length of the input.")
        max_batched = self.engine.config.scheduler.max_num_batched_tokens
        if num_tokens > max_batched:
            raise InvalidRequestError(
                f"{where} has {num_tokens} tokens, but an embedding input is computed in "
                f"one step of at most {max_batched} tokens (--max-num-batched-tokens).")
        if num_tokens > self.engine.num_kv_cache_tokens:
            raise InvalidRequestError(
                f"{where} has {num_tokens} tokens but the KV cache holds only "
                f"{self.engine.num_kv_cache_tokens}.")


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    """The vector as floats, or (OpenAI's base64) its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding
