"""POST /score and /rerank (vLLM's): scores of text pairs (engine/scoring.py says how);
POST /classify: a classifier's label probabilities per text.

A cross-encoder's pairs are tokenized together (off the event loop when large) and run
as score requests; an embedding model's distinct texts are embedded once each and every
pair scored by cosine similarity. All of a call's requests are submitted at once, all or
none, as /v1/embeddings does. /rerank scores the query against each document and returns
them best first.
"""

from __future__ import annotations

from pagedllm.engine.scoring import (classifier_params, cosine_score,
                                     cross_encoder_params, encode_pair, score_pairs)
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.score_protocol import (ClassifyData, ClassifyRequest,
                                                       ClassifyResponse, RerankDocument,
                                                       RerankRequest,
                                                       RerankResponse, RerankResult,
                                                       RerankUsage, ScoreData,
                                                       ScoreRequest, ScoreResponse,
                                                       ScoreUsage)
from pagedllm.entrypoints.openai.serving_common import OpenAIServing
from pagedllm.entrypoints.openai.serving_embedding import MAX_INPUTS
from pagedllm.errors import InvalidRequestError
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import check_truncate_prompt_tokens


class OpenAIServingScore(OpenAIServing):

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        self.check_model(request.model)
        scores, num_tokens = await self._score(score_pairs(*request.pair_texts), request)
        return ScoreResponse(id=random_id("score"), model=self.response_model(request.model),
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=ScoreUsage(prompt_tokens=num_tokens,
                                              total_tokens=num_tokens))

    async def create_rerank(self, request: RerankRequest) -> RerankResponse:
        self.check_model(request.model)
        if not request.documents:
            raise InvalidRequestError("documents must not be empty")
        scores, num_tokens = await self._score(
            score_pairs(request.query, request.documents), request)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            ranked = ranked[:request.top_n]
        results = [RerankResult(
            index=i, relevance_score=scores[i],
            document=RerankDocument(text=request.documents[i]) if request.return_documents
            else None) for i in ranked]
        return RerankResponse(id=random_id("rerank"), model=self.response_model(request.model),
                              usage=RerankUsage(total_tokens=num_tokens), results=results)

    async def create_classify(self, request: ClassifyRequest) -> ClassifyResponse:
        self.check_model(request.model)
        texts = [request.input] if isinstance(request.input, str) else request.input
        if not texts:
            raise InvalidRequestError("input must not be empty")
        if len(texts) > MAX_INPUTS:
            raise InvalidRequestError(f"input may hold at most {MAX_INPUTS} texts, got "
                                      f"{len(texts)}")
        check_truncate_prompt_tokens(request.truncate_prompt_tokens)
        prompts = [await self.pooling_prompt(text, request.truncate_prompt_tokens,
                                             f"input[{i}]") for i, text in enumerate(texts)]
        request_id = random_id("classify")
        vectors = await self.pool_all(request_id, prompts,
                                      [classifier_params(use_activation=request.use_activation)]
                                      * len(prompts), request)
        labels = getattr(self.engine.config.model.hf_config, "id2label", None) or {}
        data = []
        for i, probs in enumerate(vectors):
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassifyData(index=i, label=str(labels.get(best, f"LABEL_{best}")),
                                     probs=probs, num_classes=len(probs)))
        num_tokens = sum(len(ids) for _, ids in prompts)
        return ClassifyResponse(id=request_id,
                                model=self.response_model(request.model), data=data,
                                usage=ScoreUsage(prompt_tokens=num_tokens,
                                                 total_tokens=num_tokens))

    async def _score(self, pairs: list[tuple[str, str]],
                     request: ScoreRequest | RerankRequest) -> tuple[list[float], int]:
        """The score of each pair, and the prompt tokens they took."""
        if len(pairs) > MAX_INPUTS:
            raise InvalidRequestError(f"a call may score at most {MAX_INPUTS} pairs, got "
                                      f"{len(pairs)}")
        check_truncate_prompt_tokens(request.truncate_prompt_tokens)
        request_id = random_id("score")
        if self.engine.config.model.is_cross_encoder:
            prompts, params = [], []
            for i, (a, b) in enumerate(pairs):
                num_bytes = len(a.encode("utf-8")) + len(b.encode("utf-8"))
                self.check_prompt_bytes(num_bytes, kind=f"pair {i}")
                ids, start = await self.offloader.run(
                    "tokenizing the pair", num_bytes, encode_pair, self.tokenizer, a, b,
                    self.max_model_len, request.truncate_prompt_tokens)
                self.check_pooling_length(len(ids), f"pair {i}")
                prompts.append((None, ids))
                params.append(cross_encoder_params(start, request.use_activation))
            vectors = await self.pool_all(request_id, prompts, params, request)
            return [v[0] for v in vectors], sum(len(ids) for _, ids in prompts)
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        prompts = [await self.pooling_prompt(text, request.truncate_prompt_tokens,
                                             f"text {text[:40]!r}") for text in texts]
        params = PoolingParams()  # normalized: the cosine is then a dot product
        vectors = dict(zip(texts, await self.pool_all(request_id, prompts,
                                                      [params] * len(prompts), request)))
        scores = [cosine_score(vectors[a], vectors[b]) for a, b in pairs]
        return scores, sum(len(ids) for _, ids in prompts)
