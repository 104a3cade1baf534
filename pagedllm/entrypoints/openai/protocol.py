"""Pydantic models of the OpenAI-compatible API (the subset pagedllm serves).

Request models accept OpenAI's fields plus vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...) and pagedllm's
`priority` and `timeout`; `sampling_kwargs()` maps them onto `SamplingParams` keyword
arguments with vLLM's names. A field this server does not implement is never dropped:
an unknown one fails validation (400 naming it), and a known OpenAI field without an
implementation (`tools`, `audio`, ...) is accepted only at a value that asks for nothing
(see `UNSUPPORTED_FIELDS`). Strings must be valid Unicode (no lone surrogates) and
numbers finite.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

from pagedllm.errors import InvalidRequestError


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    """Response models (and the base of request models)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


def check_unicode(value: Any, path: str = "") -> None:
    """Raise if a string anywhere in a parsed JSON value holds a lone UTF-16 surrogate
    ("\\ud800" is valid JSON but no tokenizer can encode it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"{path or 'body'} is not valid Unicode: a lone surrogate "
                f"U+{ord(value[e.start]):04X} at character {e.start}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, path)
            check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{path}[{i}]")


# Known OpenAI request fields this server does not implement, and the values that ask
# for nothing (accepted and ignored); any other value is a 400 naming the field.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None, True, False),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,), "web_search_options": (None,), "verbosity": (None,),
    "tool_calls": (None, []), "tool_call_id": (None,), "refusal": (None,),
    "annotations": (None, []),
}


class RequestModel(OpenAIBaseModel):
    """Base of request bodies: unknown fields, non-finite numbers and invalid Unicode
    are rejected (400)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        check_unicode(data)
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = UNSUPPORTED_FIELDS.get(info.field_name or "")
        if neutral is not None and value not in neutral:
            raise InvalidRequestError(f"not supported by this server (got "
                                      f"{str(value)[:80]!r})")
        return value


# ------------------------------------------------------------------ errors, models

class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error body ({"error": {...}}), with vLLM's top-level object "error"."""

    object: Literal["error"] = "error"
    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# ------------------------------------------------------------------ sampling fields

class SamplingFields(RequestModel):
    """Fields shared by completions and chat requests (OpenAI's and vLLM's)."""

    model: str | None = None
    priority: int = 0
    """Scheduling priority (lower runs first; needs --scheduling-policy priority)."""
    timeout: float | None = Field(default=None, gt=0)
    """Deadline in seconds from arrival: unfinished by then, the request ends with a
    408 error (default: the server's --request-timeout)."""
    # OpenAI fields without an implementation (UNSUPPORTED_FIELDS).
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # int64, as vLLM: a larger seed cannot seed the sampler's generator.
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    request_id: str | None = None

    def common_sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keywords of the shared fields (None = the engine's default)."""
        kw: dict[str, Any] = {
            "n": self.n, "best_of": self.best_of, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed,
            "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "logit_bias": self.logit_bias, "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words, "prompt_logprobs": self.prompt_logprobs,
        }
        structured = self.structured_outputs_kwargs()
        if structured is not None:
            kw["structured_outputs"] = structured
        return kw

    def structured_outputs_kwargs(self) -> dict[str, Any] | None:
        """StructuredOutputsParams keywords from structured_outputs / guided_* fields."""
        if self.structured_outputs is not None:
            return dict(self.structured_outputs)
        for field, key in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, field)
            if value is not None:
                return {key: value}
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ------------------------------------------------------------------ completions

class CompletionRequest(SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def sampling_kwargs(self) -> dict[str, Any]:
        return self.common_sampling_kwargs() | {"max_tokens": self.max_tokens,
                                                "logprobs": self.logprobs}


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------ chat

class ChatMessage(RequestModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # Fields of assistant/tool messages that need tool calling (UNSUPPORTED_FIELDS).
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    function_call: Any = None
    audio: Any = None

    def text(self) -> str | None:
        """The content as one string (the parts of a multi-part content joined)."""
        if not isinstance(self.content, list):
            return self.content
        other = [p.get("type") for p in self.content if p.get("type") != "text"]
        if other:
            raise InvalidRequestError(f"only text content parts are supported, got "
                                      f"{other[0]!r}")
        return "".join(str(p.get("text", "")) for p in self.content)


class JsonSchemaFormat(RequestModel):
    name: str = "schema"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    # vLLM extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI fields without an implementation (UNSUPPORTED_FIELDS).
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None

    def sampling_kwargs(self, max_tokens: int | None) -> dict[str, Any]:
        num_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.common_sampling_kwargs() | {"max_tokens": max_tokens,
                                                "logprobs": num_logprobs}

    def structured_outputs_kwargs(self) -> dict[str, Any] | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return super().structured_outputs_kwargs()
        if fmt.type == "json_object":
            return {"json_object": True}
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            return {"json_object": True}
        return {"json": fmt.json_schema.json_schema}


class ChatLogprobTop(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------ tokenize

class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
