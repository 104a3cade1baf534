"""POST /v1/embeddings: text, texts, token ids or lists of them; float or base64 output.
POST /pooling (vLLM's): the same inputs, each one's output of the model's pooling task.
POST /v2/embed (Cohere's, as vLLM serves it): texts, with the model's
sentence-transformers prompt for `input_type` first, cut at `max_tokens` from the end
or the start (special tokens kept), and the embeddings as floats, bits packed eight to
a byte (binary: signed, ubinary: unsigned; a bit is set where the value is >= 0), or
base64 of the float32 bytes.

Every input becomes its own embedding request (PoolingParams: the model's default
pooling, cut to `dimensions` for Matryoshka models, L2-normalized unless
`use_activation` (older: `normalize`) is false), submitted all or none: a rejected input
fails the whole call (400, or 503 once the engine is gone) and aborts the others.
"""

from __future__ import annotations

import base64

import numpy as np

from pagedllm.engine.scoring import classifier_params, cross_encoder_params
from pagedllm.entrypoints.openai.embedding_protocol import (CohereBilledUnits,
                                                            CohereEmbeddings,
                                                            CohereEmbedRequest,
                                                            CohereEmbedResponse, CohereMeta,
                                                            EmbeddingData, EmbeddingRequest,
                                                            EmbeddingResponse,
                                                            EmbeddingUsage, PoolingData,
                                                            PoolingRequest, PoolingResponse)
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.serving_common import OpenAIServing
from pagedllm.errors import InvalidRequestError
from pagedllm.loader.st_config import load_st_prompts
from pagedllm.pooling_params import PoolingParams

Prompt = tuple[str | None, list[int]]  # (text or None, token ids)

# OpenAI's limit on the inputs of one embeddings call.
MAX_INPUTS = 2048


class OpenAIServingEmbedding(OpenAIServing):

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Cohere's input_type -> the text put before each input (None: the model names
        # none).
        self.task_prompts = load_st_prompts(self.engine.config.model.path)

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        outputs, usage = await self._pool(request, "embd", _embed_params(request))
        return EmbeddingResponse(data=[EmbeddingData(index=i, embedding=out)
                                       for i, out in enumerate(outputs)],
                                 model=self.response_model(request.model), usage=usage)

    async def create_pooling(self, request: PoolingRequest) -> PoolingResponse:
        """vLLM's /pooling: each input's pooled output (LLM.encode's), as the task reads
        it: the embedding, a classifier's probabilities or a cross-encoder's score."""
        task = request.task or self.engine.config.model.pooling_task
        for name in ("dimensions", "normalize"):
            if getattr(request, name) is not None and task != "embed":
                raise InvalidRequestError(f"{name} applies to embeddings, not to task "
                                          f"{task!r}")
        activation = request.use_activation
        params = {"embed": lambda: _embed_params(request),
                  "classify": lambda: classifier_params(use_activation=activation),
                  "score": lambda: cross_encoder_params(None, activation)}[task]()
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


    async def create_cohere_embedding(self, request: CohereEmbedRequest,
                                      ) -> CohereEmbedResponse:
        self.check_model(request.model)
        for name in ("images", "inputs"):
            if getattr(request, name) is not None:
                raise InvalidRequestError(f"{name} is not supported: this server embeds "
                                          f"texts (give texts)")
        if not request.texts:
            raise InvalidRequestError("texts must not be empty")
        if len(request.texts) > MAX_INPUTS:
            raise InvalidRequestError(f"texts may hold at most {MAX_INPUTS} entries, got "
                                      f"{len(request.texts)}")
        if request.output_dimension is not None:
            raise InvalidRequestError(
                "output_dimension is not supported: this model does not support matryoshka "
                "representation, so the embedding size cannot be changed")
        types = request.embedding_types or ["float"]
        if ({"binary", "ubinary"} & set(types)
                and self.engine.config.model.hf_config.hidden_size % 8):
            raise InvalidRequestError("binary and ubinary embeddings need a size that is a "
                                      "multiple of 8")
        prefix = self._task_prompt(request.input_type)
        prompts = [await self._cohere_prompt(prefix + text, request, f"texts[{i}]")
                   for i, text in enumerate(request.texts)]
        vectors = await self.pool_all(random_id("embd"), prompts,
                                      [PoolingParams()] * len(prompts), request)
        array = np.asarray(vectors, dtype=np.float32)
        embeddings = CohereEmbeddings()
        for kind in dict.fromkeys(types):
            if kind == "float":
                embeddings.float = vectors
            elif kind == "base64":
                embeddings.base64 = [_encode(v, "base64") for v in vectors]
            else:
                bits = np.packbits(array >= 0, axis=-1).astype(np.int16)
                setattr(embeddings, kind, (bits - 128 if kind == "binary" else bits).tolist())
        return CohereEmbedResponse(embeddings=embeddings, texts=list(request.texts),
                                   meta=CohereMeta(billed_units=CohereBilledUnits(
                                       input_tokens=sum(len(ids) for _, ids in prompts))))

    def _task_prompt(self, input_type: str | None) -> str:
        if input_type is None:
            return ""
        if not self.task_prompts:
            raise InvalidRequestError(f"Unsupported input_type {input_type!r}: this model "
                                      f"defines no prompts for input types")
        if input_type not in self.task_prompts:
            raise InvalidRequestError(f"Unsupported input_type {input_type!r}. Supported "
                                      f"values: {', '.join(sorted(self.task_prompts))}")
        return self.task_prompts[input_type]

    async def _cohere_prompt(self, text: str, request: CohereEmbedRequest,
                             where: str) -> Prompt:
        """One text as (text, ids), cut as `truncate` says: past max_tokens (default:
        the context) END keeps its start, START its end, each with the tokenizer's
        special tokens kept; NONE refuses it (400 naming `where`)."""
        limit = request.max_tokens or self.max_model_len
        ids = await self.encode(text, add_special_tokens=True)
        if len(ids) > limit:
            if request.truncate == "NONE":
                raise InvalidRequestError(
                    f"{where} has {len(ids)} tokens, more than {limit} "
                    f"({'max_tokens' if request.max_tokens else 'the context'}), and "
                    f"truncate is NONE: set truncate to END or START to cut it")
            body = await self.encode(text, add_special_tokens=False, check_bytes=False)
            head, tail = _special_ends(ids, body)
            keep = limit - len(head) - len(tail)
            if keep < 1:
                raise InvalidRequestError(f"max_tokens {limit} leaves no room for the text "
                                          f"beside its special tokens")
            body = body[:keep] if request.truncate == "END" else body[-keep:]
            ids, text = head + body + tail, None
        self.check_pooling_length(len(ids), where)
        return text, ids


def _special_ends(ids: list[int], body: list[int]) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer put before and after a text's own tokens: `ids`
    (with them) around `body` (without). A tokenizer that merges them into the text
    leaves no body to find: then none are kept apart."""
    extra = len(ids) - len(body)
    for start in range(extra + 1):
        if ids[start:start + len(body)] == body:
            return ids[:start], ids[start + len(body):]
    return [], []


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    """The vector as floats, or (OpenAI's base64) its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding


def _embed_params(request: EmbeddingRequest) -> PoolingParams:
    """An embeddings request's pooling (PoolingParams checks that `normalize` and
    `use_activation` agree)."""
    return PoolingParams(normalize=request.normalize, use_activation=request.use_activation,
                         dimensions=request.dimensions)
