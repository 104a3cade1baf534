"""POST /generative_scoring (vLLM's): how likely a generative model's next token after
query + item is each of the label tokens, for every item. A yes/no question becomes a
classifier: query "Is this review positive? ", items the reviews, labels the ids of
"yes" and "no"; the score is the first label's probability.

Each item is one engine request (ids `{id}-{i}`, all in flight together) that computes
its prompt and samples one token greedily with `logprob_token_ids` = the labels, so its
logprobs are the labels' (SamplingParams, sample/logprobs.py put_label_logprobs). With
`apply_softmax` (the default) the score is the first label's share of the labels'
probabilities; without, its probability over the whole vocabulary. A prompt longer than
the context is a 400 (vLLM cuts it silently to its first max_model_len - 1 tokens, which
scores a different text).
"""

from __future__ import annotations

import math
import time
from typing import Literal

from pydantic import Field, StrictInt

from pagedllm.entrypoints.openai.protocol import UsageInfo, random_id
from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel, RequestModel
from pagedllm.entrypoints.openai.serving_common import OpenAIServing
from pagedllm.entrypoints.openai.serving_embedding import MAX_INPUTS
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import MAX_LOGPROB_TOKEN_IDS, SamplingParams


class GenerativeScoringRequest(RequestModel):
    model: str | None = None
    query: str | list[StrictInt]
    """Text, or token ids (taken as they are)."""
    items: list[str] | list[list[StrictInt]] = Field(min_length=1, max_length=MAX_INPUTS)
    """Texts (tokenized without special tokens) or token ids, each scored after (or,
    with item_first, before) the query."""
    label_token_ids: list[StrictInt] = Field(min_length=1,
                                             max_length=MAX_LOGPROB_TOKEN_IDS)
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    """For a text query (a BOS first, as the tokenizer adds them)."""
    cache_salt: str | None = None
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)
    request_id: str | None = Field(default=None, max_length=256)


class GenerativeScoringItemResult(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class GenerativeScoringResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[GenerativeScoringItemResult]
    usage: UsageInfo


class OpenAIServingGenerativeScoring(OpenAIServing):

    async def create_generative_scoring(self, request: GenerativeScoringRequest,
                                        ) -> GenerativeScoringResponse:
        self.check_model(request.model)
        self.check_generation()
        texts = isinstance(request.query, str) or isinstance(request.items[0], str)
        if texts and self.tokenizer is None:
            raise InvalidRequestError("a text query or item needs a tokenizer, and this "
                                      "server loads none: give token ids")
        query = (await self.encode(request.query, request.add_special_tokens)
                 if isinstance(request.query, str) else list(request.query))
        prompts: list[tuple[str | None, list[int]]] = []
        for i, item in enumerate(request.items):
            ids = (await self.encode(item, add_special_tokens=False)
                   if isinstance(item, str) else list(item))
            ids = ids + query if request.item_first else query + ids
            if not ids:
                raise InvalidRequestError(f"items[{i}]: the query and the item are empty")
            if len(ids) >= self.max_model_len:
                raise InvalidRequestError(
                    f"items[{i}]: query and item are {len(ids)} tokens, and a prompt may "
                    f"have at most {self.max_model_len - 1} (max_model_len "
                    f"{self.max_model_len}, less the token scored)")
            prompts.append((None, ids))
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                logprob_token_ids=list(request.label_token_ids))
        request_id = request.request_id or random_id("generative-scoring")
        # The engine checks each prompt (vocabulary, labels, cache_salt) as it takes it.
        finals = await self.run_all(request_id, prompts, [params] * len(prompts), request)
        data = []
        for i, final in enumerate(finals):
            out = final.outputs[0]
            step = out.logprobs[0] if out.logprobs else None
            if step is None or out.finish_reason not in ("length", "stop"):
                raise InvalidRequestError(f"items[{i}] ended without a score "
                                          f"({out.finish_reason})")
            logprobs = [step[t].logprob for t in request.label_token_ids]
            data.append(GenerativeScoringItemResult(
                index=i, score=_score(logprobs, request.apply_softmax)))
        num_prompt = sum(len(ids) for _, ids in prompts)
        return GenerativeScoringResponse(
            id=request_id, model=self.response_model(request.model), data=data,
            usage=self.usage(num_prompt, len(prompts),
                             sum(f.num_cached_tokens or 0 for f in finals if f)))


def _score(logprobs: list[float], apply_softmax: bool) -> float:
    """The first label's probability: among the labels (a softmax of their logprobs),
    or over the vocabulary."""
    if not apply_softmax:
        return math.exp(logprobs[0])
    top = max(logprobs)
    if top == -math.inf:  # every label impossible: no share to give
        return 0.0
    weights = [math.exp(lp - top) for lp in logprobs]
    return weights[0] / sum(weights)
