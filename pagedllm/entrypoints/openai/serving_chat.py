"""POST /v1/chat/completions: the model's chat template (or --chat-template), n,
logprobs + top_logprobs, max_tokens / max_completion_tokens, response_format
(json_object, json_schema), tool calling (tool_calling.py), reasoning split off the
answer (--reasoning-parser; pagedllm/reasoning.py), streaming."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from pagedllm.engine.content_format import ContentFormat, detect_content_format
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest,
                                                  ChatCompletionResponse,
                                                  ChatCompletionResponseChoice,
                                                  ChatCompletionStreamResponse,
                                                  ChatMessage, ChatResponseMessage,
                                                  ChatStreamChoice, DeltaMessage,
                                                  prompt_logprobs_field, random_id)
from pagedllm.entrypoints.openai.serve_config import RESERVED_TEMPLATE_KWARGS
from pagedllm.entrypoints.openai.serving_common import (OpenAIServing, SSEResponse,
                                                        logprobs_bytes,
                                                        merge_streams,
                                                        prompt_logprobs_bytes, sse,
                                                        sse_error)
from pagedllm.entrypoints.openai.tool_calling import (ToolCallReader, ToolPlan, plan_tools,
                                                      response_tool_calls,
                                                      stream_tool_calls)
from pagedllm.errors import ConfigError, InvalidRequestError
from pagedllm.mm_inputs import ProcessedImage
from pagedllm.multimodal.content import load_images, template_parts
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.reasoning import Phase, ReasoningReader
from pagedllm.sampling_params import SamplingParams


# What reading one message into the template's form costs, counted as bytes of input
# for the offloader (~2 us: past a few dozen messages, a worker thread does it).
MESSAGE_COST_BYTES = 256


@dataclass
class PreparedChat:
    """A checked chat request, rendered: what submitting and reading it need."""

    text: str | None
    ids: list[int]
    params: SamplingParams
    plan: ToolPlan
    phase: Phase | None
    """Where the reply starts (None: no reasoning parser)."""
    images: list[ProcessedImage] = field(default_factory=list)
    """Its images, preprocessed (a multimodal model's)."""


@dataclass
class ChoiceState:
    num_chars: int = 0
    num_tokens: int = 0
    is_finished: bool = False
    reasoning: ReasoningReader | None = None
    tools: ToolCallReader | None = None


class OpenAIServingChat(OpenAIServing):

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # --chat-template, read once at start-up (None: the tokenizer's own).
        self.chat_template = self.serve_config.load_chat_template()
        # How that template reads message contents (content_format.py).
        configured = self.serve_config.chat_template_content_format
        if configured == "string" and self.engine.image_processor is not None:
            raise ConfigError("--chat-template-content-format string cannot carry images: "
                              "a multimodal model's template reads parts (auto, openai)")
        own = (getattr(self.tokenizer, "chat_template", None) if self.chat_template is None
               else self.chat_template)
        self.content_format: ContentFormat = (
            detect_content_format(own if isinstance(own, str) else None)
            if configured == "auto" else configured)
        # --reasoning-parser's format and tags (None: replies are all content).
        self.reasoning = self.engine.reasoning_tokens
        # tool_choice "auto"'s parser, resolved once (a plugin file runs once).
        self.auto_tool_parser = self.serve_config.auto_tool_parser()
        self.media_policy = self.serve_config.media_policy()

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     ) -> ChatCompletionResponse | Response | SSEResponse:
        prepared = await self.prepare(request)
        request_id = request.request_id or random_id("chatcmpl")
        plan, phase = prepared.plan, prepared.phase
        streams = self.add_requests(request_id, [(prepared.text, prepared.ids)],
                                    [prepared.params], request, images=prepared.images)
        if request.stream:
            return SSEResponse(self._stream(request, request_id, streams, plan, phase,
                                            prepared.ids),
                               self.serve_config.sse_keep_alive_interval)
        final = await self.final_output(request_id, streams)
        choices = []
        echo = _echo_text(request)
        for out in sorted(final.outputs, key=lambda o: o.index):
            message, finish_reason = self.message_of(out, self.reasoning_reader(phase),
                                                     plan.new_reader())
            message.role = self.reply_role(request)
            if not request.include_reasoning:
                message.reasoning = message.reasoning_content = None
            if echo:
                message.content = echo + (message.content or "")

            def choice(out=out, message=message, finish_reason=finish_reason,
                       ) -> ChatCompletionResponseChoice:
                logprobs = (self.chat_logprobs(out.token_ids, out.logprobs, request.top,
                                           self.tokens_as_ids(request))
                            if request.logprobs else None)
                ids = {"token_ids": list(out.token_ids)} if request.return_token_ids else {}
                return ChatCompletionResponseChoice(
                    index=out.index, message=message, logprobs=logprobs,
                    finish_reason=finish_reason, stop_reason=out.stop_reason, **ids)
            choices.append(choice)
        num_completion = sum(len(o.token_ids) for o in final.outputs)
        usage = self.usage(len(final.prompt_token_ids), num_completion,
                           final.num_cached_tokens)
        k = request.prompt_logprobs

        def envelope() -> ChatCompletionResponse:
            field = prompt_logprobs_field(final.prompt_logprobs) if k is not None else None
            ids = ({"prompt_token_ids": final.prompt_token_ids}
                   if request.return_token_ids else {})
            return ChatCompletionResponse(id=request_id, model=self.response_model(request.model),
                                          choices=[], usage=usage, prompt_logprobs=field,
                                          metrics=self.timing([final], num_completion), **ids)

        size = prompt_logprobs_bytes(k, 1, len(final.prompt_token_ids)) + logprobs_bytes(
            request.top_logprobs or 0 if request.logprobs else None, num_completion)
        return await self.choices_response(envelope, choices, size)

    async def final_output(self, request_id: str, streams: list) -> RequestOutput:
        """The finished output of a non-streaming request (aborted if the caller is
        cancelled first)."""
        final = None
        try:
            async for _, out in merge_streams(streams):
                final = out
        finally:
            self.abort_all(request_id, 1)  # no-op unless cancelled
        assert final is not None
        return final

    async def prepare(self, request: ChatCompletionRequest) -> PreparedChat:
        """Check a chat request and render it: its prompt, SamplingParams, use of tools
        and where its reply starts (400s for what is wrong)."""
        self.check_model(request.model)
        self.check_generation()
        if request.top_logprobs is not None:
            if request.top_logprobs < 0:
                raise InvalidRequestError(f"top_logprobs must be non-negative, got "
                                          f"{request.top_logprobs}")
            if not request.logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs to be true")
        self.check_limits(request, request.top_logprobs, logprobs_field="top_logprobs")
        plan = plan_tools(request, self.auto_tool_parser,
                          self.serve_config.exclude_tools_when_tool_choice_none)
        text, ids, sources = await self.render_chat(
            request.messages, request.add_generation_prompt, request.continue_final_message,
            request.chat_template, template_kwargs(request), tools=plan.template_tools)
        images = await self.preprocess_images(sources)
        if images and request.truncate_prompt_tokens is not None:
            raise InvalidRequestError("truncate_prompt_tokens cannot be used with images "
                                      "(it could cut an image's placeholder tokens)")
        text, ids = self.truncate(text, ids, request.truncate_prompt_tokens)
        requested = (request.max_completion_tokens if request.max_completion_tokens is not None
                     else request.max_tokens)
        if requested is not None and requested < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {requested}.")
        # The prompt's length as the engine runs it: each image its whole run (and the
        # placeholders checked against the images now, before anything is queued).
        num_tokens = len(ids)
        if images:
            num_tokens = len(self.engine.image_processor.expand(ids, len(images))[0])
        max_tokens = self.check_length(num_tokens, requested, kind="messages")
        kwargs = request.sampling_kwargs(max_tokens)
        if plan.constraint is not None:
            kwargs["structured_outputs"] = plan.constraint
        await self.read_constraint(kwargs)
        params = self.sampling_params(kwargs, request.stream,
                                      self.engine.config.model.sampling_defaults)
        try:
            await self.check_constraints(params)
        except InvalidRequestError as e:
            if plan.constraint is None:
                raise
            raise InvalidRequestError(f"tools: cannot force tool calls with these "
                                      f"parameter schemas: {e}") from e
        # Where the reply starts: in a reasoning or not (the prompt may decide it).
        phase = self.reasoning.initial_phase(ids) if self.reasoning is not None else None
        return PreparedChat(text, ids, params, plan, phase, images)

    def reply_role(self, request: ChatCompletionRequest) -> str:
        """The role a reply names, as vLLM's: --response-role after the generation
        prompt; a continued (or prompt-less) last message's own role otherwise."""
        if request.add_generation_prompt and not request.continue_final_message:
            return self.serve_config.response_role
        return request.messages[-1].role

    def reasoning_reader(self, phase: Phase | None) -> ReasoningReader | None:
        """A reader of one choice's reasoning (None: no reasoning parser)."""
        if self.reasoning is None or phase is None:
            return None
        return ReasoningReader(self.reasoning.format, phase)

    @staticmethod
    def message_of(out: CompletionOutput, reasoner: ReasoningReader | None,
                   reader: ToolCallReader | None) -> tuple[ChatResponseMessage, str | None]:
        """A choice's message (its reasoning split off, its calls read from the rest)
        and finish reason."""
        text, reasoning = out.text, None
        if reasoner is not None:
            reasoning, text = _join(reasoner.feed(text), reasoner.finish())
            # An answer that never came is null, as OpenAI's content beside calls.
            reasoning, text = reasoning or None, text or (None if reasoning else text)
        if reader is None:
            return (ChatResponseMessage(content=text, reasoning=reasoning,
                                        reasoning_content=reasoning), out.finish_reason)
        parsed = reader.read_all(text or "")
        calls = response_tool_calls(parsed.tool_calls)
        content = parsed.content if parsed.content or not (calls or reasoning) else None
        return (ChatResponseMessage(content=content, reasoning=reasoning,
                                    reasoning_content=reasoning, tool_calls=calls or None),
                reader.finish_reason(out.finish_reason))

    async def preprocess_images(self, sources: list[Any]) -> list[ProcessedImage]:
        """A conversation's images decoded and through the model's image processor, off
        the event loop (a large image takes tens of milliseconds)."""
        if not sources:
            return []
        processor = self.engine.image_processor
        size = sum(len(s) if isinstance(s, str) else 0 for s in sources)

        def work() -> list[ProcessedImage]:
            processor.check_count(len(sources))  # before decoding any of them
            return processor.preprocess(load_images(sources, self.media_policy))

        # Never inline: even a small image is resized to the model's input size.
        return await self.offloader.run("decoding images", size + (1 << 20), work)

    def _conversation(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
                      content_format: ContentFormat,
                      ) -> tuple[list[dict[str, Any]], list[Any], int]:
        """The messages as the template reads them (contents as one string, or as parts:
        a multimodal model's always), their images (multimodal models), and the bytes
        the template will print of them (a JSON estimate of calls and tools)."""
        sources: list[Any] = []
        multimodal = self.engine.image_processor is not None
        if not multimodal and content_format == "string":
            conversation = [m.template_dict() for m in messages]
        else:
            conversation = []
            for m in messages:
                if not multimodal:
                    m.text()  # refuses image parts by name
                parts, found = template_parts(m.content)
                conversation.append(m.template_dict(content=parts))
                sources += found
        num_bytes = sum(_text_bytes(m["content"]) + len(m["role"])
                        + len(m.get("reasoning", "").encode("utf-8"))
                        for m in conversation)
        num_bytes += sum(len(json.dumps(m.get("tool_calls", ""))) for m in conversation)
        num_bytes += len(json.dumps(tools)) if tools else 0
        return conversation, sources, num_bytes

    async def render_chat(self, messages: list[ChatMessage],
                          add_generation_prompt: bool = True,
                          continue_final_message: bool = False,
                          chat_template: str | None = None,
                          chat_template_kwargs: dict | None = None,
                          tools: list[dict[str, Any]] | None = None,
                          ) -> tuple[str, list[int], list[Any]]:
        """The prompt text of a conversation through the chat template, its ids, and
        its images not yet decoded (data URLs), in placeholder order (one placeholder
        token per image in the ids).

        The template is the request's, else --chat-template, else the tokenizer's; it
        gets `tools` as plain dicts. A multimodal model's template reads each message's
        content as parts (multimodal/content.py); other models' refuse image parts.
        Large conversations and request-supplied templates render off the event loop
        with a time limit (offload.py); a request template needs
        --trust-request-chat-template.
        """
        if not messages:
            raise InvalidRequestError("messages must not be empty")
        if chat_template is not None and not self.serve_config.trust_request_chat_template:
            raise InvalidRequestError("`chat_template` in a request is disabled on this server "
                                      "(start it with --trust-request-chat-template)")
        reserved = sorted((chat_template_kwargs or {}).keys() & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved[0]!r}")
        # The server's defaults (--default-chat-template-kwargs, checked at start-up)
        # under the request's own.
        kwargs = (self.serve_config.default_chat_template_kwargs or {}) | (
            chat_template_kwargs or {})
        content_format = self.content_format
        if chat_template is not None and self.serve_config.chat_template_content_format == "auto":
            content_format = await self.offloader.run(
                "reading the chat template", len(chat_template), detect_content_format,
                chat_template)
        conversation, sources, num_bytes = await self.offloader.run(
            "reading the conversation", MESSAGE_COST_BYTES * len(messages),
            self._conversation, messages, tools, content_format)
        self.check_prompt_bytes(num_bytes, kind="conversation")
        try:
            text = await self.offloader.run(
                "rendering the chat template", num_bytes + 256 * len(conversation),
                self.tokenizer.apply_chat_template, conversation, tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                chat_template=chat_template or self.chat_template,
                untrusted=chat_template is not None, **kwargs)
        except InvalidRequestError:
            raise
        except Exception as e:  # jinja errors, a missing template: the request's fault
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from e
        if not isinstance(text, str):
            raise InvalidRequestError("the chat template did not render to text")
        # The template holds the special tokens already: don't let encode add BOS again.
        return (text, await self.encode(text, add_special_tokens=False, check_bytes=False),
                sources)

    async def prompt_token_ids(self, messages: list[ChatMessage],
                               add_generation_prompt: bool, continue_final_message: bool,
                               chat_template: str | None,
                               chat_template_kwargs: dict | None,
                               tools: list[dict[str, Any]] | None) -> list[int]:
        """A conversation's prompt ids as the engine runs them (/tokenize, Anthropic's
        count_tokens): rendered, each image placeholder expanded (nothing decoded)."""
        _, ids, images = await self.render_chat(
            messages, add_generation_prompt, continue_final_message, chat_template,
            chat_template_kwargs, tools=tools or None)
        if images:
            ids, _ = self.engine.image_processor.expand(ids, len(images))
        return ids

    # ------------------------------------------------------------------ streaming

    async def _stream(self, request: ChatCompletionRequest, request_id: str,
                      streams: list, plan: ToolPlan, phase: Phase | None,
                      prompt_ids: list[int] | None = None) -> AsyncIterator[str]:
        states = {i: ChoiceState(reasoning=self.reasoning_reader(phase),
                                  tools=plan.new_reader()) for i in range(request.n)}
        num_prompt_tokens = 0
        latest = None  # the latest output (its timestamps)

        def chunk(choice: ChatStreamChoice, **extra: Any) -> str:
            return sse(ChatCompletionStreamResponse(
                id=request_id, model=self.response_model(request.model),
                choices=[choice], **extra).model_dump_json())

        try:
            # OpenAI's first chunk per choice carries the role.
            role = self.reply_role(request)
            echo = _echo_text(request)
            for i in range(request.n):
                # return_token_ids: the prompt's ids once, on the first chunk.
                first = ({"prompt_token_ids": prompt_ids}
                         if request.return_token_ids and i == 0 else {})
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role=role,
                                                                         content="")),
                            **first)
                if echo:
                    yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=echo)))
            async for _, ro in merge_streams(streams):
                latest = ro
                num_prompt_tokens = len(ro.prompt_token_ids)
                num_cached_tokens = ro.num_cached_tokens
                for out in ro.outputs:
                    st = states.setdefault(out.index, ChoiceState())
                    if st.is_finished:
                        continue
                    delta = out.text[st.num_chars:] if len(out.text) > st.num_chars else ""
                    new_ids = out.token_ids[st.num_tokens:]
                    logprobs = None
                    if request.logprobs and new_ids:
                        new_lps = out.logprobs[st.num_tokens:] if out.logprobs else None
                        logprobs = self.chat_logprobs(new_ids, new_lps, request.top,
                                                  self.tokens_as_ids(request))
                    st.num_chars = max(st.num_chars, len(out.text))
                    st.num_tokens = len(out.token_ids)
                    st.is_finished = out.finish_reason is not None
                    message, finish_reason = self.delta_of(st, delta, out.finish_reason)
                    if not request.include_reasoning:
                        message.reasoning = message.reasoning_content = None
                    ids = {"token_ids": list(new_ids)} if request.return_token_ids else {}
                    if (message.content or message.reasoning or message.tool_calls
                            or logprobs or st.is_finished or (ids and new_ids)):
                        yield chunk(ChatStreamChoice(
                            index=out.index, delta=message, logprobs=logprobs,
                            finish_reason=finish_reason, stop_reason=out.stop_reason, **ids))
            if request.include_usage or self.serve_config.enable_force_include_usage:
                num_completion = sum(s.num_tokens for s in states.values())
                usage = self.usage(num_prompt_tokens, num_completion, num_cached_tokens)
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, model=self.response_model(request.model), choices=[],
                    usage=usage, metrics=self.timing([latest] if latest else [], num_completion),
                ).model_dump_json())
        except Exception as e:
            yield sse_error(e)
        finally:
            self.abort_all(request_id, 1)
        yield sse("[DONE]")

    @staticmethod
    def delta_of(st: ChoiceState, text: str, finish_reason: str | None,
                 ) -> tuple[DeltaMessage, str | None]:
        """A chunk's message of new text: its reasoning split off, the rest through the
        choice's tool-call reader (both may hold text back until they know where it
        belongs)."""
        reasoning = ""
        if st.reasoning is not None:
            parts = st.reasoning.feed(text)
            if st.is_finished:
                parts = _join(parts, st.reasoning.finish())
            reasoning, text = parts
        if st.tools is None:
            return (DeltaMessage(content=text or None, reasoning=reasoning or None,
                                 reasoning_content=reasoning or None), finish_reason)
        parsed = st.tools.feed(text)
        if st.is_finished:
            parsed.extend(st.tools.finish())
            finish_reason = st.tools.finish_reason(finish_reason)
        return (DeltaMessage(content=parsed.content or None, reasoning=reasoning or None,
                             reasoning_content=reasoning or None,
                             tool_calls=stream_tool_calls(parsed.tool_calls) or None),
                finish_reason)


def _join(first: tuple[str, str], second: tuple[str, str]) -> tuple[str, str]:
    """Two (reasoning, content) releases as one."""
    return first[0] + second[0], first[1] + second[1]


def _echo_text(request: ChatCompletionRequest) -> str:
    """What `echo` (vLLM's chat extra) puts before each reply: the last message's text
    when it is the assistant's own (a reply continuing it, as with
    continue_final_message), else nothing."""
    if not request.echo or not request.messages or request.messages[-1].role != "assistant":
        return ""
    content = request.messages[-1].content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if part.get("type") == "text")
    return content or ""


def _text_bytes(content: str | list[dict[str, Any]]) -> int:
    """UTF-8 bytes of a template message's text (its text parts' for a parts list)."""
    if isinstance(content, str):
        return len(content.encode("utf-8"))
    return sum(len(p.get("text", "").encode("utf-8")) for p in content)


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """The request's chat_template_kwargs, with its reasoning_effort unless they set it."""
    if request.reasoning_effort is None:
        return request.chat_template_kwargs
    return {"reasoning_effort": request.reasoning_effort} | (request.chat_template_kwargs
                                                              or {})
