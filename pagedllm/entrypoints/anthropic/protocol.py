"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): request and
response bodies, and each request as the chat request that asks for the same reply.

The request models follow the server's rules (protocol_base.py): unknown fields, and
content block or tool types this server cannot honour, are a 400 naming them. What
asks for nothing is accepted: `cache_control` (prefix caching is automatic here),
`citations` on text sent back, a thinking block's `signature` (nothing is verified),
`metadata.user_id`, `service_tier`.

The conversion (`MessagesRequest.to_chat_request`):
- `system` (a string or text blocks, joined by blank lines) is the first message, a
  "system" message; messages with role "system" stay where they are.
- A user message's `tool_result` blocks become "tool" messages (one per result, in
  order, before the rest of that message); its text and image blocks its content.
- An assistant message's text is its content, its `thinking` its reasoning, each
  `tool_use` a call (input as the arguments' JSON); `redacted_thinking` is dropped (its
  text is not readable).
- A conversation ending with an assistant message is a prefill, as Anthropic's: the
  reply continues that message (continue_final_message).
- tool_choice auto / any / tool / none -> "auto" / "required" / named / "none";
  `disable_parallel_tool_use` -> parallel_tool_calls false. With tools and no choice,
  "auto", as Anthropic's (it needs --enable-auto-tool-choice, as for chat).
- `thinking` -> the chat template's `enable_thinking` (true for "enabled" and
  "adaptive", false for "disabled"; templates that do not read it ignore it), and
  "enabled"'s `budget_tokens` -> thinking_token_budget (as vLLM's) when the server has a
  reasoning parser (without one there is no reasoning to bound: max_tokens bounds the
  whole reply).
- `output_config.format` / `output_format` (a JSON schema) -> response_format.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel, RequestModel
from pagedllm.errors import InvalidRequestError

# Anthropic's error types by HTTP status (others: invalid_request_error for a 4xx,
# api_error for a 5xx).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}

BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


def error_body(message: str, status: int) -> dict[str, Any]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class CacheControl(RequestModel):
    """Accepted and unused: every full KV block is cached anyway (prefix caching)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None
    """A reply's citations sent back: accepted and unused (nothing here cites)."""


class Base64Source(RequestModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(RequestModel):
    type: Literal["url"]
    url: str


class ImageBlock(RequestModel):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def chat_part(self) -> dict[str, Any]:
        """The image as a chat content part (a data URL for base64 data)."""
        src = self.source
        url = src.url if isinstance(src, URLSource) else f"data:{src.media_type};base64,{src.data}"
        return {"type": "image_url", "image_url": {"url": url}}


class DirectCaller(RequestModel):
    type: Literal["direct"]


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: DirectCaller | None = None
    """Only the model's own calls (no server tool calls code here)."""


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool | None = None
    """Accepted; the result's text is what the model reads (as chat's tool messages)."""
    cache_control: CacheControl | None = None


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    """Accepted and not verified."""


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock
                         | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]


def _known_blocks(content: Any, where: str) -> Any:
    """A clear 400 for a block type this server has no use for (documents, server tools'
    results...), before pydantic's tag error."""
    for i, block in enumerate(content if isinstance(content, list) else ()):
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in BLOCK_TYPES:
            raise InvalidRequestError(f"{where}[{i}]: content blocks of type {kind!r} are "
                                      f"not supported by this server (supported: "
                                      f"{', '.join(BLOCK_TYPES)})")
    return content


class Message(RequestModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, content: Any) -> Any:
        return _known_blocks(content, "content")

    @model_validator(mode="after")
    def _blocks_fit_role(self) -> Message:
        allowed = {"user": ("text", "image", "tool_result"), "system": ("text",),
                   "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
        for i, block in enumerate(self.content if isinstance(self.content, list) else ()):
            if block.type not in allowed[self.role]:
                raise InvalidRequestError(f"content[{i}]: a {block.type!r} block is not "
                                          f"allowed in a {self.role!r} message")
        return self


class Tool(RequestModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None
    """Accepted: tool_choice any / tool are schema-exact anyway (guided decoding)."""
    eager_input_streaming: bool | None = None
    """Accepted: a call's input streams as the model writes it."""
    input_examples: list[dict[str, Any]] | None = None
    """Accepted and unused (chat templates have no place for them)."""
    defer_loading: Literal[False] | None = None
    """True needs Anthropic's tool search, a server tool."""
    allowed_callers: list[Literal["direct"]] | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") != "object":
            raise InvalidRequestError('input_schema must be a JSON schema of type "object"')
        return schema


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_iff_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise InvalidRequestError('tool_choice needs `name` with type "tool" (only)')
        return self


ThinkingDisplay = Literal["summarized", "omitted"]
"""omitted: thinking blocks come with empty text (and their signature)."""


class ThinkingEnabled(RequestModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    display: ThinkingDisplay | None = None


class ThinkingDisabled(RequestModel):
    type: Literal["disabled"]


class ThinkingAdaptive(RequestModel):
    type: Literal["adaptive", "between_tools"]
    display: ThinkingDisplay | None = None


class JsonOutputFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    """Given to the chat template as `reasoning_effort` (templates that read it)."""


class Metadata(RequestModel):
    user_id: str | None = None


def _server_tools(tools: Any) -> Any:
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise InvalidRequestError(
                f"tools[{i}]: Anthropic's server tools (type {str(kind)[:60]!r}) do not run "
                f"on this server: give client tools (name, description, input_schema)")
    return tools


class CountTokensRequest(RequestModel):
    """POST /v1/messages/count_tokens: the prompt's length as /v1/messages renders it."""

    SUPPORTED_FIELDS = frozenset({"metadata", "service_tier"})

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive,
                        Field(discriminator="type")] | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    """Accepted: this server runs every request at its one speed."""
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # vLLM's extra
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools(cls, tools: Any) -> Any:
        return _server_tools(tools)

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, system: Any) -> Any:
        return _known_blocks(system, "system")

    @model_validator(mode="after")
    def _tool_exchanges(self) -> CountTokensRequest:
        check_tool_results(self.messages)
        if self.output_config and self.output_config.format and self.output_format:
            raise InvalidRequestError("give one of output_config.format and output_format")
        return self

    def chat_body(self) -> dict[str, Any]:
        """The chat request's body for this conversation, tools and options (no
        sampling fields)."""
        messages = _system_messages(self.system) + [
            m for message in self.messages for m in _chat_messages(message)]
        prefill = self.messages[-1].role == "assistant"
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "add_generation_prompt": not prefill,
                                "continue_final_message": prefill}
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            kwargs.setdefault("enable_thinking", self.thinking.type != "disabled")
        if self.output_config is not None and self.output_config.effort is not None:
            kwargs.setdefault("reasoning_effort", self.output_config.effort)
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        fmt = self.output_format or (self.output_config.format if self.output_config else None)
        if fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt.json_schema}}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = (
                {"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        return body

    def to_chat_request(self) -> ChatCompletionRequest:
        return _chat_request(self.chat_body())


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=0)
    """0: the prompt is computed (into the prefix cache) and nothing is generated."""
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    container: Any = None
    diagnostics: Any = None

    @field_validator("container", "diagnostics")
    @classmethod
    def _unsupported_option(cls, value: Any) -> Any:
        if value is not None:
            raise InvalidRequestError("not supported by this server (containers and "
                                      "prompt-cache diagnostics are Anthropic's)")
        return value
    # vLLM's extras
    cache_salt: str | None = None
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)
    priority: int = 0
    request_id: str | None = None
    vllm_xargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        if isinstance(self.thinking, ThinkingEnabled) and (
                self.thinking.budget_tokens >= self.max_tokens):
            raise InvalidRequestError("thinking.budget_tokens must be less than max_tokens")
        return self

    @property
    def show_thinking(self) -> bool:
        return getattr(self.thinking, "display", None) != "omitted"

    def to_chat_request(self, budget_thinking: bool = False) -> ChatCompletionRequest:
        """`budget_thinking`: the server reads reasoning (a reasoning parser), so
        thinking's budget_tokens bounds it."""
        body = self.chat_body() | {
            # max_tokens 0 computes the prompt all the same: one token, not returned.
            "max_tokens": max(self.max_tokens, 1), "stop": self.stop_sequences,
            "stream": self.stream, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "cache_salt": self.cache_salt, "seed": self.seed,
            "priority": self.priority, "request_id": self.request_id,
            "vllm_xargs": self.vllm_xargs}
        if budget_thinking and isinstance(self.thinking, ThinkingEnabled):
            body["thinking_token_budget"] = self.thinking.budget_tokens
        return _chat_request(body)


def check_tool_results(messages: list[Message]) -> None:
    """Anthropic's rule: an assistant message's tool_use blocks are answered by the
    tool_result blocks of the user message right after it, one per id, and a
    tool_result answers a tool_use of the message before it."""
    pending: set[str] = set()
    for i, message in enumerate(messages):
        blocks = message.content if isinstance(message.content, list) else []
        results = [b.tool_use_id for b in blocks if isinstance(b, ToolResultBlock)]
        for tool_use_id in results:
            if tool_use_id not in pending:
                raise InvalidRequestError(
                    f"messages[{i}]: tool_result block for {tool_use_id!r}, which is not an "
                    f"unanswered tool_use id of the message before")
            pending.discard(tool_use_id)
        if pending:
            raise InvalidRequestError(
                f"messages[{i}]: tool_use ids without a tool_result block right after "
                f"them: {sorted(pending)[:5]}")
        if message.role == "assistant":
            for block in blocks:
                if isinstance(block, ToolUseBlock):
                    if block.id in pending:
                        raise InvalidRequestError(f"messages[{i}]: the tool_use id "
                                                  f"{block.id!r} is used twice")
                    pending.add(block.id)
    # A last assistant message with calls: the client has not run them yet; the chat
    # request refuses it, naming the rule.


def _system_messages(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n\n".join(b.text for b in system)
    return [{"role": "system", "content": text}] if text else []


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user message's tool results first, as
    tool messages; an assistant message's calls and reasoning on it."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append(block.chat_part())
        elif isinstance(block, ToolResultBlock):
            content = (block.content if isinstance(block.content, str)
                       else [b.chat_part() if isinstance(b, ImageBlock)
                             else {"type": "text", "text": b.text} for b in block.content])
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": content})
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input)}})
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
    if parts or calls or reasoning or message.role != "user":
        chat: dict[str, Any] = {"role": message.role, "content": _content(parts)}
        if calls:
            chat["tool_calls"] = calls
        if reasoning:
            chat["reasoning"] = "".join(reasoning)
        out.append(chat)
    return out


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]] | None:
    """Text parts alone as one string (every template reads that); with images, parts."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts) if parts else None
    return parts


def _chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request of a converted body; what it refuses is a 400 (its message
    names the chat form: the Anthropic fields were checked before)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        raise InvalidRequestError(f"{loc}: {msg}" if loc else msg) from None


# ------------------------------------------------------------------ responses

class Usage(OpenAIBaseModel):
    """Anthropic's usage: input_tokens excludes the prompt tokens read from the prefix
    cache (cache_read_input_tokens) and those the request wrote to it
    (cache_creation_input_tokens), as Anthropic counts them."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageResponse(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(OpenAIBaseModel):
    input_tokens: int
