"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the
chat handler.

A request becomes the chat request asking for the same reply (protocol.py), which the
chat handler checks, renders and submits; its one output is read the chat way
(reasoning split off, tool calls parsed) and returned as content blocks: a `thinking`
block, a `text` block, one `tool_use` block per call (a reply with none of these: one
empty text block, as Anthropic's). A stream sends Anthropic's events as the pieces
arrive: message_start (once the engine's first output tells how much of the prompt
the prefix cache held), per block content_block_start / _delta / _stop, then
message_delta (stop reason, usage) and message_stop; the message a client assembles
from them equals the non-streaming answer. An error after the stream began is an
`error` event.

stop_reason: "max_tokens" when the length ran out, else "tool_use" when the reply
calls tools, "stop_sequence" (with the sequence) when one of stop_sequences ended it,
"end_turn" otherwise; null for an aborted request.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.entrypoints.anthropic.protocol import (CountTokensRequest, CountTokensResponse,
                                                     MessageResponse, MessagesRequest, Usage,
                                                     error_body)
from pagedllm.entrypoints.openai.protocol import ChatResponseMessage
from pagedllm.entrypoints.openai.serving_chat import (ChoiceState, OpenAIServingChat,
                                                      PreparedChat)
from pagedllm.entrypoints.openai.serving_common import (SSEResponse, error_status,
                                                        exception_message, merge_streams)
from pagedllm.outputs import CompletionOutput, RequestOutput


class AnthropicServingMessages(OpenAIServingChat):

    async def create_message(self, request: MessagesRequest) -> Any:
        chat = request.to_chat_request(self.reasoning is not None)
        prepared = await self.prepare(chat)
        message_id = chat.request_id or f"msg_{uuid.uuid4().hex}"
        streams = self.add_requests(message_id, [(prepared.text, prepared.ids)],
                                    [prepared.params], chat, images=prepared.images)
        model = self.response_model(request.model)
        if request.stream:
            return SSEResponse(self._events(request, message_id, model, streams, prepared),
                               self.serve_config.sse_keep_alive_interval)
        final = await self.final_output(message_id, streams)
        out = final.outputs[0]
        if request.max_tokens == 0:  # the prompt only: its one token is not returned
            content, reason, sequence, num_output = [], "max_tokens", None, 0
        else:
            message, _ = self.message_of(out, self.reasoning_reader(prepared.phase),
                                         prepared.plan.new_reader())
            content = _blocks(message, request.show_thinking)
            reason, sequence = stop_reason(out, bool(message.tool_calls))
            num_output = len(out.token_ids)

        def build() -> MessageResponse:
            return MessageResponse(id=message_id, model=model, content=content,
                                   stop_reason=reason, stop_sequence=sequence,
                                   usage=self._usage(final, num_output))
        return await self.json_response(build, len(out.text.encode("utf-8")))

    def _usage(self, ro: RequestOutput, num_output: int) -> Usage:
        """Anthropic's counts: the prompt tokens read from the prefix cache, those this
        request wrote to it (its prompt's full blocks beyond the hits: each is cached once
        computed, as vLLM counts cache creation), and the rest."""
        num_prompt, cached = len(ro.prompt_token_ids), ro.num_cached_tokens or 0
        cache = self.engine.config.cache
        created = (max(0, num_prompt // cache.block_size * cache.block_size - cached)
                   if cache.enable_prefix_caching else 0)
        return Usage(input_tokens=num_prompt - cached - created, output_tokens=num_output,
                     cache_read_input_tokens=cached, cache_creation_input_tokens=created)

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        """The prompt's tokens as /v1/messages would run it (system, tools and images
        included)."""
        chat = request.to_chat_request()
        self.check_model(chat.model)
        tools = [t.model_dump(exclude_none=True) for t in chat.tools or ()]
        if chat.effective_tool_choice == "none" and (
                self.serve_config.exclude_tools_when_tool_choice_none):
            tools = []
        ids = await self.prompt_token_ids(
            chat.messages, chat.add_generation_prompt, chat.continue_final_message,
            chat.chat_template, chat.chat_template_kwargs, tools)
        return CountTokensResponse(input_tokens=len(ids))

    async def _events(self, request: MessagesRequest, message_id: str, model: str,
                      streams: list, prepared: PreparedChat) -> AsyncIterator[str]:
        st = ChoiceState(reasoning=self.reasoning_reader(prepared.phase),
                         tools=prepared.plan.new_reader())
        blocks = _BlockStream(request.show_thinking)
        prompt_only = request.max_tokens == 0
        started = False
        used_tools = False
        try:
            async for _, ro in merge_streams(streams):
                out = ro.outputs[0]
                if not started:
                    started = True
                    start = MessageResponse(id=message_id, model=model, content=[],
                                            stop_reason=None, usage=self._usage(ro, 0))
                    yield event("message_start", message=start.model_dump())
                if prompt_only:
                    if out.finish_reason is not None:
                        yield event("message_delta", delta={"stop_reason": "max_tokens",
                                                            "stop_sequence": None},
                                    usage=self._usage(ro, 0).model_dump())
                        yield event("message_stop")
                    continue
                text = out.text[st.num_chars:]
                st.num_chars = max(st.num_chars, len(out.text))
                st.num_tokens = len(out.token_ids)
                st.is_finished = out.finish_reason is not None
                message, _ = self.delta_of(st, text, out.finish_reason)
                if message.reasoning:
                    yield blocks.delta("thinking", message.reasoning)
                if message.content:
                    yield blocks.delta("text", message.content)
                for call in message.tool_calls or ():
                    if call.id is not None:
                        used_tools = True
                        yield blocks.start_tool(call.id, call.function.name)
                    if call.function is not None and call.function.arguments:
                        yield blocks.delta("tool_use", call.function.arguments)
                if not st.is_finished:
                    continue
                if blocks.index < 0:  # no content at all: one empty text block
                    yield blocks.open("text")
                yield blocks.close()
                reason, sequence = stop_reason(out, used_tools)
                usage = self._usage(ro, st.num_tokens).model_dump()
                yield event("message_delta", delta={"stop_reason": reason,
                                                    "stop_sequence": sequence}, usage=usage)
                yield event("message_stop")
        except Exception as e:
            status = int(error_status(e))
            yield event("error", **error_body(exception_message(e), status))
        finally:
            self.abort_all(message_id, 1)


def event(kind: str, **fields: Any) -> str:
    """One server-sent event of Anthropic's stream: its type as the event name and as
    the data's `type`."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


class _BlockStream:
    """The stream's content blocks: the open one (its type, index) and the events that
    start, extend and stop them."""

    DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
              "tool_use": ("input_json_delta", "partial_json")}

    def __init__(self, show_thinking: bool = True) -> None:
        self.show_thinking = show_thinking
        self.index = -1
        self.kind: str | None = None
        self.thinking: list[str] = []  # the open thinking block's text (its signature)

    def open(self, kind: str, **block: Any) -> str:
        """Close the open block (if any) and start a `kind` block."""
        events = self.close()
        self.index += 1
        self.kind = kind
        initial = {"text": {"text": ""}, "thinking": {"thinking": "", "signature": ""},
                   "tool_use": {"input": {}}}[kind]
        return events + event("content_block_start", index=self.index,
                              content_block={"type": kind, **block, **initial})

    def start_tool(self, call_id: str, name: str | None) -> str:
        return self.open("tool_use", id=call_id, name=name or "")

    def delta(self, kind: str, piece: str) -> str:
        """`piece` added to a `kind` block: the open one, or a new one."""
        events = self.open(kind) if self.kind != kind else ""
        if kind == "thinking":
            self.thinking.append(piece)
            if not self.show_thinking:  # display "omitted": the signature only
                return events
        name, key = self.DELTAS[kind]
        return events + event("content_block_delta", index=self.index,
                              delta={"type": name, key: piece})

    def close(self) -> str:
        if self.kind is None:
            return ""
        events = ""
        if self.kind == "thinking":
            events = event("content_block_delta", index=self.index, delta={
                "type": "signature_delta", "signature": signature("".join(self.thinking))})
            self.thinking = []
        self.kind = None
        return events + event("content_block_stop", index=self.index)


def signature(thinking: str) -> str:
    """A thinking block's `signature`: Anthropic's clients require one and send it back,
    and nothing here verifies it; a digest of the text keeps a stream's block equal to
    the non-streaming one."""
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def _blocks(message: ChatResponseMessage, show_thinking: bool = True,
            ) -> list[dict[str, Any]]:
    """A whole reply's content blocks (thinking's text left out unless shown)."""
    blocks: list[dict[str, Any]] = []
    if message.reasoning:
        blocks.append({"type": "thinking",
                       "thinking": message.reasoning if show_thinking else "",
                       "signature": signature(message.reasoning)})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls or ():
        blocks.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                       "input": _arguments(call.function.arguments)})
    return blocks or [{"type": "text", "text": ""}]


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as an object (the parsers release JSON objects; a call a
    length limit cut short may hold less: then {})."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(out: CompletionOutput, used_tools: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished output."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if out.finish_reason not in ("stop", "tool_calls"):
        return None, None  # aborted
    if used_tools:
        return "tool_use", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


