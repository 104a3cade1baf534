"""Bodies of the Tokens In<>Out API (vLLM's POST /inference/v1/generate).

A prompt of token ids and vLLM's SamplingParams as they are in; token ids (with
integer-keyed logprobs) out, or text too with `output_mode` "text". Made for callers that
tokenize and detokenize themselves: RL rollouts, routers in front of disaggregated
servers, a separate renderer.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializeAsAny, StrictInt, field_validator

from pagedllm.entrypoints.openai.protocol import (ChatLogprobs, PerRequestMetrics,
                                                  PromptLogprobs, StreamOptions, UsageInfo)
from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel, RequestModel
from pagedllm.errors import InvalidRequestError


class GenerateSamplingParams(RequestModel):
    """vLLM's SamplingParams fields, each checked here for its type and by
    SamplingParams for its value. A field this engine lacks is a 400 naming it."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = None
    """None: what the context leaves (vLLM's server default, not SamplingParams' 16)."""
    min_tokens: int = 0
    logprobs: int | None = None
    logprob_token_ids: list[StrictInt] | None = Field(default=None, max_length=128)
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: dict[str, Any] | None = None
    thinking_token_budget: StrictInt | None = None  # (vLLM's: no bool, float or str)
    extra_args: dict[str, Any] | None = None
    # vLLM's, set by its own server: a caller's value is ignored (the stream decides).
    output_kind: int | str | None = None


class GenerateRequest(RequestModel):
    request_id: str | None = Field(default=None, max_length=256)
    """The caller's id (the response's is `generate-tokens-<id>`); default: the
    X-Request-Id header, else a random one."""
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSamplingParams
    model: str | None = None
    return_token_ids: bool | None = None
    """The prompt's token ids in the response (a stream's first chunk)."""
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(default=0, ge=-(2 ** 63), le=2 ** 63 - 1)
    timeout: float | None = Field(default=None, gt=0)
    """pagedllm's: a deadline in seconds, as on completions."""
    cache_salt: str | None = None
    """Only requests with the same salt share prefix-cache blocks."""
    # vLLM's fields for what this server does not do: accepted when empty.
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, ids: list[int]) -> list[int]:
        if any(t < 0 for t in ids):
            raise InvalidRequestError("token_ids must not contain negative values")
        return ids

    @field_validator("kv_transfer_params", "ec_transfer_params", "features",
                     "content_parts", "reasoning_parser_kwargs")
    @classmethod
    def _not_supported(cls, value: Any, info: Any) -> Any:
        if value:
            raise InvalidRequestError(f"`{info.field_name}` is not supported by this server")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: Any, info: Any) -> Any:
        if value is not None and not info.data.get("stream"):
            raise InvalidRequestError("stream_options is only allowed with stream: true")
        return value


class AbortRequest(RequestModel):
    request_ids: list[str] = Field(max_length=4096)


class GenerateLogProb(OpenAIBaseModel):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    """The sampled token at one position and its alternatives (the sampled one first,
    then by rank): a list, as JSON keys would turn the ids into strings."""

    top_logprobs: list[GenerateLogProb] = Field(default_factory=list)


class GenerateLogProbs(OpenAIBaseModel):
    content: list[GenerateLogProbsContent] | None = None


class GenerateChoice(OpenAIBaseModel):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    logprobs: GenerateLogProbs | ChatLogprobs | None = None


class GenerateTextChoice(GenerateChoice):
    text: str
    """The text (a stream's: what is new); output_mode "text" only."""


class GenerateResponse(OpenAIBaseModel):
    request_id: str
    output_mode: Literal["tokens", "text"] = "tokens"
    model: str | None = None
    created: int | None = None
    # Each choice as its own class (a text choice keeps its text).
    choices: list[SerializeAsAny[GenerateChoice]]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    metrics: PerRequestMetrics | None = None
