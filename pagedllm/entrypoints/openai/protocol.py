"""Pydantic models of the OpenAI-compatible API (the subset pagedllm serves).

Request models accept OpenAI's fields plus vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...) and pagedllm's
`priority` and `timeout`; `sampling_kwargs()` maps them onto `SamplingParams` keyword
arguments with vLLM's names. A field this server does not implement is never dropped:
an unknown one fails validation (400 naming it), and a known OpenAI field without an
implementation (`audio`, `functions`, ...) is accepted only at a value that asks for
nothing (see `UNSUPPORTED_FIELDS`). Strings must be valid Unicode (no lone surrogates)
and numbers finite. Tool calling's models and checks are in tool_protocol.py.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (Field, StrictInt, ValidationInfo, field_validator, model_serializer,
                      model_validator)

from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel, RequestModel
# Re-exported: this module stays the one place to import the API's models from.
from pagedllm.entrypoints.openai.protocol_base import (  # noqa: F401
    UNSUPPORTED_FIELDS, check_json_value, random_id)
from pagedllm.entrypoints.openai.tool_protocol import (DeltaToolCall, NamedToolChoice,
                                                       ToolCall, ToolCallParam, ToolParam,
                                                       check_message_tool_fields,
                                                       check_tool_choice,
                                                       check_tool_choice_form,
                                                       check_tool_exchanges, check_tools)
from pagedllm.errors import InvalidRequestError


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
    # A LoRA adapter's base model (None for the base model itself).
    parent: str | None = None
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: int | None = None  # accepted for vLLM clients; the name decides


class CollectiveRPCRequest(RequestModel):
    """POST /collective_rpc (--enable-dev-endpoints): a worker method by name, with
    JSON arguments."""

    method: str = Field(min_length=1)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = Field(default=None, gt=0)

    @field_validator("method")
    @classmethod
    def _public_method(cls, method: str) -> str:
        # A name, not a path into the worker's internals ("__class__" would build one).
        if not method.isidentifier() or method.startswith("_"):
            raise InvalidRequestError(f"method must name a public worker method, got "
                                      f"{method[:80]!r}")
        return method


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details (OpenAI's shape).
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# OpenAI's reasoning_effort values (chat; Responses' reasoning.effort).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


# ------------------------------------------------------------------ sampling fields

# vLLM's older constraint fields, and the structured_outputs key each stands for.
_GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"),
                  ("guided_choice", "choice"), ("guided_grammar", "grammar"))


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
    truncate_prompt_tokens: int | None = None
    """Keep the prompt's last k tokens (-1: max_model_len), before the length checks."""
    structured_outputs: dict[str, Any] | None = None
    thinking_token_budget: StrictInt | None = None
    """Most reasoning tokens before the end tag is forced (vLLM's; needs
    --reasoning-parser); -1: no limit. Strict, as vLLM's: no bool, float or string."""
    return_tokens_as_token_ids: bool | None = None
    """Logprobs name tokens "token_id:<id>" instead of their text (for tokens that are
    no valid UTF-8 alone); default: --return-tokens-as-token-ids."""
    return_token_ids: bool | None = None
    """vLLM's: each choice carries its generated `token_ids` and the prompt's
    `prompt_token_ids` (completions: on the choice; chat: on the response); a stream
    sends each chunk's new ids, the prompt's on its first chunk."""
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    """Only requests with the same salt share prefix-cache blocks (vLLM's: a tenant
    cannot learn another's prompts from the cache's timing)."""
    vllm_xargs: dict[str, Any] | None = None
    """Arguments for the server's custom logits processors (--logits-processors):
    SamplingParams.extra_args, as vLLM's."""

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            # As OpenAI and vLLM: options of a stream that will not be sent are a mistake.
            raise InvalidRequestError("stream_options is only allowed with stream: true")
        return self

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
            "extra_args": self.vllm_xargs, "thinking_token_budget": self.thinking_token_budget,
        }
        structured = self.structured_outputs_kwargs()
        if structured is not None:
            kw["structured_outputs"] = structured
        return kw

    def structured_outputs_kwargs(self) -> dict[str, Any] | None:
        """StructuredOutputsParams keywords from structured_outputs / guided_* fields;
        InvalidRequestError when more than one is set (one would be silently lost)."""
        given = self.constraint_fields()
        if len(given) > 1:
            raise InvalidRequestError(f"give only one constraint, got {' and '.join(given)}")
        if self.structured_outputs is not None:
            return dict(self.structured_outputs)
        for field, key in _GUIDED_FIELDS:
            value = getattr(self, field)
            if value is not None:
                return {key: value}
        return None

    def constraint_fields(self) -> list[str]:
        """The request's fields that ask for a constraint on the output."""
        return [name for name in ("structured_outputs", *(f for f, _ in _GUIDED_FIELDS))
                if getattr(self, name) is not None]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ------------------------------------------------------------------ completions

class CompletionRequest(SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    prompt_embeds: str | list[str] | None = None
    """vLLM's: base64 of torch.save(tensor [tokens, hidden_size]), or a list of them, in
    place of prompt (--enable-prompt-embeds)."""
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


def clamp_logprob(value: float) -> float:
    """JSON has no -inf: clamp like vLLM."""
    return max(value, -9999.0)


# vLLM's `prompt_logprobs` response field: per prompt token None (the first, which
# nothing predicts) or {token id: {"logprob", "rank", "decoded_token"}} for the token
# itself and the top-k. Plain dicts, typed Any: an 8,000-token prompt has ~170,000
# entries, which pydantic would take ~0.6 s to validate.
PromptLogprobs = list[Any]


def prompt_logprobs_field(prompt_logprobs: list | None) -> PromptLogprobs | None:
    """RequestOutput.prompt_logprobs (outputs.Logprob dicts) as the response field."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {token_id: {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                        "decoded_token": lp.decoded_token}
             for token_id, lp in entry.items()}
            for entry in prompt_logprobs]


class PerRequestMetrics(OpenAIBaseModel):
    """A request's timing (vLLM's, with --enable-per-request-metrics), in ms from the
    engine's clock; None where a timestamp it needs is missing."""

    time_to_first_token_ms: float | None = None
    """First scheduled to first token (the queue excluded)."""
    generation_time_ms: float | None = None
    """First token to last token."""
    queue_time_ms: float | None = None
    """Arrival to first scheduled."""
    mean_itl_ms: float | None = None
    """generation_time_ms over the tokens after the first."""
    tokens_per_second: float | None = None
    """Tokens generated over first scheduled to last token."""


def _absent(value: Any) -> bool:
    return value is None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extension, when the request asked for prompt_logprobs.
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    # --enable-per-request-metrics: the whole response's, or a stream's usage chunk's.
    metrics: PerRequestMetrics | None = Field(default=None, exclude_if=_absent)


# ------------------------------------------------------------------ chat

class ChatMessage(RequestModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    """An assistant message's calls (its content may then be null)."""
    tool_call_id: str | None = None
    """A tool message's answer to this call id."""
    reasoning: str | None = None
    """An assistant message's reasoning, as replies carry it (vLLM's); templates that
    show past reasoning (Qwen3's) read it as `reasoning_content`."""
    reasoning_content: str | None = None
    """The older name of `reasoning` (either may be given)."""
    # Fields without an implementation (UNSUPPORTED_FIELDS).
    refusal: str | None = None
    annotations: list[Any] | None = None
    function_call: Any = None
    audio: Any = None

    @field_validator("content")
    @classmethod
    def _content_parts(cls, content: Any) -> Any:
        for i, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part.get("type"), str):
                raise InvalidRequestError(f"content[{i}] needs a `type` string")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"content[{i}].text must be a string, got "
                                          f"{type(part.get('text')).__name__}")
        return content

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        check_message_tool_fields(self.role, self.content, self.tool_calls,
                                  self.tool_call_id)
        if self.role != "assistant" and (self.reasoning is not None
                                         or self.reasoning_content is not None):
            raise InvalidRequestError(f"`reasoning` is only allowed in assistant messages, "
                                      f"not in a {self.role!r} message")
        return self

    def template_dict(self, content: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The message as chat templates read it: content as one string (null content
        becomes "", which templates can concatenate), or the `content` parts given (a
        multimodal template's), calls with decoded arguments."""
        message: dict[str, Any] = {"role": self.role,
                                   "content": self.text() or "" if content is None
                                   else content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning
        return message

    def text(self) -> str | None:
        """The content as one string (the parts of a multi-part content joined)."""
        if not isinstance(self.content, list):
            return self.content
        other = [p.get("type") for p in self.content if p.get("type") != "text"]
        if other:
            raise InvalidRequestError(f"only text content parts are supported by this "
                                      f"model, got "
                                      f"{other[0]!r}")
        return "".join(p["text"] for p in self.content)


class JsonSchemaFormat(RequestModel):
    name: str = "schema"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # type "structural_tag" (vLLM's): xgrammar's `format`, or the older `structures`
    # ({begin, schema, end}) with their `triggers`.
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    def structural_tag(self) -> dict[str, Any]:
        tag: dict[str, Any] = {"type": "structural_tag"}
        for name in ("format", "structures", "triggers"):
            if getattr(self, name) is not None:
                tag[name] = getattr(self, name)
        return tag


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    # vLLM extras
    logprob_token_ids: list[StrictInt] | None = Field(default=None, max_length=128)
    """With logprobs: each token's top_logprobs are these tokens' (in this order)
    instead of the most likely ones (vLLM's; e.g. the label tokens of a classifier)."""
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    """With --reasoning-parser: False leaves the reasoning out of the reply."""
    reasoning_effort: ReasoningEffort | None = None
    """Given to the chat template as `reasoning_effort` (unless chat_template_kwargs sets
    it): templates that read it (gpt-oss's) set the model's reasoning budget with it;
    others render as without it."""
    # Tool calling (tool_protocol.py; serving: tool_calling.py)
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: "auto" with tools, "none" without (OpenAI's)."""
    parallel_tool_calls: bool | None = None
    """False: at most one call per choice (default: any number)."""
    # OpenAI's identifiers, taken and unused as `user` is: the prefix cache needs no key
    # (agents such as Codex send one with every request).
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # OpenAI fields without an implementation (UNSUPPORTED_FIELDS).
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None

    @field_validator("messages")
    @classmethod
    def _tool_exchanges(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        check_tool_exchanges(messages)
        return messages

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[ToolParam] | None) -> list[ToolParam] | None:
        return check_tools(tools)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_form(cls, choice: Any) -> Any:
        """One clear message for a malformed choice (not one per member of the union)."""
        check_tool_choice_form(choice)
        return choice

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice: Any, info: ValidationInfo) -> Any:
        if "tools" in info.data:  # else `tools` is invalid: that is the error
            check_tool_choice(choice, info.data["tools"])
        return choice

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """tool_choice with OpenAI's default: "auto" if there are tools, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def sampling_kwargs(self, max_tokens: int | None) -> dict[str, Any]:
        if self.logprob_token_ids is not None and not self.logprobs:
            raise InvalidRequestError("logprob_token_ids needs logprobs: true")
        num_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if self.logprob_token_ids is not None:  # (top_logprobs then gives way, as vLLM's)
            num_logprobs = len(self.logprob_token_ids)
        return self.common_sampling_kwargs() | {
            "max_tokens": max_tokens, "logprobs": num_logprobs,
            "logprob_token_ids": self.logprob_token_ids}

    @property
    def top(self) -> int | list[int]:
        """What each token's top_logprobs list: the given tokens, or the k most likely."""
        return self.logprob_token_ids or self.top_logprobs or 0

    def structured_outputs_kwargs(self) -> dict[str, Any] | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return super().structured_outputs_kwargs()
        if self.constraint_fields():
            raise InvalidRequestError(f"give only one constraint, got response_format and "
                                      f"{' and '.join(self.constraint_fields())}")
        if fmt.type == "json_object":
            return {"json_object": True}
        if fmt.type == "structural_tag":
            return {"structural_tag": fmt.structural_tag()}
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


class _OmitsNoToolCalls(OpenAIBaseModel):
    """A message whose `tool_calls` is left out of the body when the model made no call
    (as OpenAI), and its reasoning fields when there is no reasoning (a server without
    --reasoning-parser sends OpenAI's fields only)."""

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        if data.get("reasoning") is None:
            data.pop("reasoning", None)
            data.pop("reasoning_content", None)
        return data


class ChatResponseMessage(_OmitsNoToolCalls):
    role: str = "assistant"
    content: str | None = None
    # The reasoning (--reasoning-parser) under vLLM's current name and its older one.
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class BatchChatCompletionRequest(ChatCompletionRequest):
    """POST /v1/chat/completions/batch (vLLM's): `messages` is a list of conversations,
    each run as a chat request with the other fields and answered as choice i. Not
    streamed; no tools, n 1, no echo or prompt_logprobs (as vLLM's)."""

    messages: list[list[ChatMessage]] = Field(min_length=1)  # type: ignore[assignment]

    @field_validator("messages")
    @classmethod
    def _tool_exchanges(cls, conversations: list[list[ChatMessage]],
                        ) -> list[list[ChatMessage]]:
        for i, conversation in enumerate(conversations):
            if not conversation:
                raise InvalidRequestError(f"messages[{i}] must not be empty")
            try:
                check_tool_exchanges(conversation)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"conversation {i}: {e}") from None
        return conversations

    @model_validator(mode="after")
    def _batch_limits(self) -> BatchChatCompletionRequest:
        refused = [name for name, asked in (
            ("stream", self.stream), ("tools", self.tools), ("n", self.n != 1),
            ("best_of", self.best_of not in (None, 1)), ("echo", self.echo),
            ("prompt_logprobs", self.prompt_logprobs is not None)) if asked]
        if refused:
            raise InvalidRequestError(f"{refused[0]} is not supported by the batch route "
                                      f"(send each conversation to /v1/chat/completions)")
        return self

    def conversation(self, i: int) -> ChatCompletionRequest:
        """Conversation i as its own chat request (the fields checked already)."""
        fields = {name: getattr(self, name) for name in ChatCompletionRequest.model_fields}
        return ChatCompletionRequest.model_construct(
            _fields_set=self.model_fields_set, **(fields | {"messages": self.messages[i]}))


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
    metrics: PerRequestMetrics | None = Field(default=None, exclude_if=_absent)
    # vLLM's extension, when the request asked for prompt_logprobs.
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(_OmitsNoToolCalls):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
    metrics: PerRequestMetrics | None = Field(default=None, exclude_if=_absent)


# ------------------------------------------------------------------ tokenize

class TokenizeRequest(RequestModel):
    """A prompt, or a conversation rendered as a chat request with the same fields
    would render it (vLLM's /tokenize)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    """Also answer each token's text (`token_strs`)."""

    @field_validator("messages")
    @classmethod
    def _tool_exchanges(cls, messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if messages is not None:
            check_tool_exchanges(messages)
        return messages

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[ToolParam] | None) -> list[ToolParam] | None:
        return check_tools(tools)


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
