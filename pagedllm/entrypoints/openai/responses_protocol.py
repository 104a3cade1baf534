"""Pydantic models of POST /v1/responses (OpenAI's Responses API, as vLLM serves it:
stateless) and the translation of its input into a chat request.

A Responses request is a chat request in other clothes: `instructions` is a system
message, `input` a string (one user message) or a list of items (messages, the model's
function calls, their outputs, its reasoning), `tools` are function tools, `text.format`
is the response format, `max_output_tokens` caps the reply. `to_chat_request` builds the
ChatCompletionRequest the chat handler checks, renders and runs; serving_responses.py
turns the chat reply into output items. `store` and `previous_response_id` need the
server's response store (responses_store.py, --enable-responses-store), as does
`background` (the response is answered at once, "queued", and runs on; the client polls
GET /v1/responses/{id} or cancels it).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (Field, TypeAdapter, ValidationError, field_validator,
                      model_validator)

from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, ChatLogprobToken,
                                                  ReasoningEffort)
from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel, RequestModel
from pagedllm.errors import InvalidRequestError


# The one `include` value this server gives (the others name what it does not have:
# encrypted reasoning, hosted tools' results, input image URLs).
OUTPUT_LOGPROBS = "message.output_text.logprobs"


def item_id(prefix: str) -> str:
    """OpenAI's shape of an id: a prefix ("resp", "msg", "fc", "rs") and hex."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------ request

class TextPart(RequestModel):
    """Text of a message: the user's (input_text) or, sent back, the model's."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ImagePart(RequestModel):
    """An image of a user message (a multimodal model's): a data URL."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["low", "high", "auto"] | None = None


class InputMessage(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as a chat message's: its text, or parts when it has images."""
        if isinstance(self.content, str) or not any(
                isinstance(part, ImagePart) for part in self.content):
            return self.text()
        return [{"type": "image_url", "image_url": {"url": part.image_url}}
                if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
                for part in self.content]


class FunctionCallItem(RequestModel):
    """A call the model made (sent back with the conversation)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestModel):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningPart(RequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInputItem(RequestModel):
    """The model's reasoning (sent back): given to the next assistant message."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(part.text for part in (self.content or self.summary))


InputItem = Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem
                      | ReasoningInputItem, Field(discriminator="type")]
INPUT_ITEMS = TypeAdapter(list[InputItem])


class ReasoningOptions(RequestModel):
    """`reasoning`: the effort goes to the chat template as `reasoning_effort` (as the
    chat API's); no summaries are written (the reasoning itself comes back as
    reasoning_text), so a summary is accepted only as "auto" (the model's choice)."""

    effort: ReasoningEffort | None = None
    summary: str | None = None
    generate_summary: str | None = None
    """OpenAI's older name of summary."""

    @model_validator(mode="after")
    def _no_summary_asked(self) -> ReasoningOptions:
        for name in ("summary", "generate_summary"):
            value = getattr(self, name)
            if value not in (None, "auto"):
                raise InvalidRequestError(
                    f"reasoning.{name} {value[:40]!r} is not supported by this server (it "
                    f"writes no summaries: the reasoning itself comes back as "
                    f"reasoning_text; \"auto\" is accepted)")
        return self


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: None = None


class ResponsesRequest(RequestModel):
    SUPPORTED_FIELDS: ClassVar[frozenset[str]] = frozenset({"store"})

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    text: TextConfig | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    """Accepted: the prefix cache needs no key."""
    store: bool | None = None
    """Keep the response (OpenAI's default: true) for previous_response_id and GET:
    needs --enable-responses-store, without which only false (or none) is taken."""
    previous_response_id: str | None = None
    """Continue a stored response's conversation (its input and output items)."""
    background: bool | None = None
    """Answer at once with the stored response "queued" and run it on (needs the store,
    and store not false); with `stream`, its events go to the client while it listens
    and it runs on if the client leaves."""
    include: list[str] | None = None
    """Only "message.output_text.logprobs": the logprobs of the reply's text."""
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    """How many alternatives each of those logprobs lists (with `include` only)."""
    # OpenAI fields this server refuses unless at their neutral value (metadata,
    # service_tier: UNSUPPORTED_FIELDS; the others: _nothing_asked).
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning: ReasoningOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    """"auto": a conversation too long for the context drops its oldest turns (whole
    user turns: a call's output never outlives its call) until it fits."""
    # vLLM extras
    request_id: str | None = None
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _default_item_type(cls, value: Any) -> Any:
        """An item with a role and no type is a message (OpenAI's easy input form)."""
        if isinstance(value, list):
            return [{"type": "message", **item}
                    if isinstance(item, dict) and "type" not in item and "role" in item
                    else item for item in value]
        return value

    @model_validator(mode="after")
    def _nothing_asked(self) -> ResponsesRequest:
        """What this server cannot give is refused by name, never silently dropped."""
        if self.background and self.store is False:  # OpenAI's rule: it is stored
            raise InvalidRequestError("background: true needs store: true (a background "
                                      "response is fetched from the store)")
        other = sorted(set(self.include or ()) - {OUTPUT_LOGPROBS})
        if other:
            raise InvalidRequestError(f"`include` {other[0][:80]!r} is not supported by this "
                                      f"server (only {OUTPUT_LOGPROBS!r})")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())

    def input_items(self) -> list[Any]:
        """`input` as items (a text is one user message)."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input)

    def turn_starts(self, earlier: tuple[Any, ...] = ()) -> list[int]:
        """Where the conversation (`earlier` items, then the input's) may be cut for
        truncation "auto": at each user message but the first item, oldest first."""
        items = [*earlier, *self.input_items()]
        return [i for i, item in enumerate(items) if i > 0
                and isinstance(item, InputMessage) and item.role == "user"]

    def to_chat_request(self, earlier: tuple[Any, ...] = (), start: int = 0,
                        ) -> ChatCompletionRequest:
        """The chat request that asks for the same reply, after the `earlier` items of a
        stored conversation (the conversation from item `start` on: a truncated one);
        InvalidRequestError for a conversation the chat API would refuse (a call output
        without its call...)."""
        messages = _messages(self.instructions, [*earlier, *self.input_items()][start:])
        if not messages:  # the chat request would name `messages`, which was not sent
            raise InvalidRequestError("input has no message: give a text or at least one "
                                      "message, function call or call output item")
        body: dict[str, Any] = {
            "model": self.model, "messages": messages,
            "max_completion_tokens": self.max_output_tokens, "stream": self.stream}
        for name in ("temperature", "top_p", "parallel_tool_calls", "user", "request_id",
                     "priority", "timeout", "seed", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "chat_template_kwargs"):
            body[name] = getattr(self, name)
        if self.reasoning is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.wants_logprobs:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        if self.tools:
            body["tools"] = [{"type": "function", "function": tool.model_dump(
                exclude={"type"}, exclude_none=True)} for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice.name}}
        else:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = (
                {"type": "json_object"} if fmt.type == "json_object" else
                {"type": "json_schema", "json_schema": {
                    "name": fmt.name or "schema", "schema": fmt.json_schema,
                    "description": fmt.description, "strict": fmt.strict}})
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise InvalidRequestError(f"input: {_first_error(e)}") from e


def _messages(instructions: str | None, items: list[Any]) -> list[dict[str, Any]]:
    """Chat messages of the instructions and input items: calls join the assistant
    message before them (or start one), reasoning goes to the next assistant message."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningInputItem):
            reasoning = (reasoning or "") + item.text()
        elif isinstance(item, InputMessage):
            role = "system" if item.role == "developer" else item.role
            message: dict[str, Any] = {"role": role, "content": item.chat_content()}
            if role == "assistant" and reasoning is not None:
                message["reasoning"], reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    messages[-1]["reasoning"], reasoning = reasoning, None
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text()})
    return messages


def _first_error(e: ValidationError) -> str:
    error = e.errors()[0]
    where = ".".join(str(p) for p in error.get("loc", ()))
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


# ------------------------------------------------------------------ response

class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatLogprobToken] = Field(default_factory=list)
    """With include ["message.output_text.logprobs"]: one per token of the reply after
    its reasoning (a reply that goes on to call a tool: the call's tokens too)."""
    logprobs_json: str | None = Field(default=None, exclude=True)
    """Those logprobs as JSON instead (a long reply's: strings, which the garbage
    collector does not walk; sliced_json.to_json writes them); never sent as a key."""


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningItem(OpenAIBaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutput(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | ReasoningItem | FunctionCallOutput


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(OpenAIBaseModel):
    """Why a background response failed."""

    code: str
    message: str


ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "cancelled",
                         "failed"]


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=time.time)
    status: ResponseStatus
    background: bool = False
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = False
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: dict[str, Any] | None = None
