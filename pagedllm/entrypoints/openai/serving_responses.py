"""POST /v1/responses: OpenAI's Responses API over the chat handler.

The request becomes a chat request (responses_protocol.py), which the chat handler
checks, renders and submits; its reply is read the chat way (reasoning split off, tool
calls parsed) and returned as output items: a reasoning item, a message with one
output_text part, one function_call item per call. A stream sends OpenAI's typed events
(response.created, response.output_item.added, response.output_text.delta, ...,
response.completed, whose response says "incomplete" when max_output_tokens cut it)
as the same pieces arrive, each numbered by `sequence_number`; its
final response equals the one a non-streaming request gets.

A background request (`background: true`, with the store on) is answered at once with
its response "queued"; a task runs it on and stores it "in_progress", then finished
("completed" / "incomplete"), "failed" (its error) or "cancelled" (POST
/v1/responses/{id}/cancel, or DELETE). Each holds one engine request, and at most
--max-background-responses run at once (503 past it): a client that leaves nothing
open still cannot queue without bound.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from pagedllm.engine.async_llm import AsyncLLM, QueueFullError
from pagedllm.entrypoints.openai.offload import INLINE_BYTES, Offloader
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatLogprobToken
from pagedllm.entrypoints.openai.responses_protocol import (FunctionCallOutput,
                                                            IncompleteDetails,
                                                            InputTokensDetails,
                                                            OutputMessage, OutputText,
                                                            OutputTokensDetails,
                                                            ReasoningItem, ReasoningText,
                                                            ResponseError, ResponseObject,
                                                            ResponseStatus,
                                                            ResponsesRequest, ResponseUsage,
                                                            item_id)
from pagedllm.entrypoints.openai.sliced_json import fields_json, to_json
from pagedllm.entrypoints.openai.responses_replay import EventLog, replay
from pagedllm.entrypoints.openai.responses_store import ResponseStore, as_input_items
from pagedllm.entrypoints.openai.responses_stream import ItemStream
from pagedllm.entrypoints.openai.serve_config import ServeConfig
from pagedllm.entrypoints.openai.served_models import ServedModels
from pagedllm.entrypoints.openai.serving_chat import (MESSAGE_COST_BYTES, ChoiceState,
                                                      OpenAIServingChat, PreparedChat)
from pagedllm.entrypoints.openai.serving_common import (SSEResponse, error_body,
                                                        error_status, exception_message,
                                                        logprobs_bytes, merge_streams)
from pagedllm.errors import ContextLengthError, InvalidRequestError
from pagedllm.outputs import RequestOutput


class OpenAIServingResponses(OpenAIServingChat):

    def __init__(self, engine: AsyncLLM, models: ServedModels, serve_config: ServeConfig,
                 offloader: Offloader) -> None:
        super().__init__(engine, models, serve_config, offloader)
        # None: stateless (--enable-responses-store off).
        self.store = (ResponseStore(serve_config.responses_store_max_bytes)
                      if serve_config.enable_responses_store else None)
        # Background responses running, by response id (each holds one engine request).
        self._background: dict[str, asyncio.Task] = {}
        self._max_background = serve_config.max_background_responses
        # The event logs of the background streams running, by response id.
        self._logs: dict[str, EventLog] = {}

    def _earlier_items(self, request: ResponsesRequest) -> tuple[Any, ...]:
        """The stored conversation `previous_response_id` continues (() for none);
        refuses what needs the store when it is off."""
        if self.store is None:
            for asked, name in ((request.store, "store: true"),
                                (request.background, "background: true"),
                                (request.previous_response_id, "previous_response_id")):
                if asked:
                    raise InvalidRequestError(
                        f"{name} needs the server's response store, which is off: start "
                        f"it with --enable-responses-store, or send the whole "
                        f"conversation as input")
            return ()
        if request.previous_response_id is None:
            return ()
        return self.store.get(request.previous_response_id).conversation

    def _stores(self, request: ResponsesRequest) -> bool:
        """Whether the response is kept: the store is on and the request does not say
        store: false (OpenAI's default is true)."""
        return self.store is not None and request.store is not False

    def _keep(self, request: ResponsesRequest, response: ResponseObject,
              earlier: tuple[Any, ...], done: _Done | None = None) -> ResponseObject:
        """`response`, stored if `_stores(request)` (`done`: what _complete measured of
        it off the loop)."""
        if self.store is not None and response.store:
            outputs = as_input_items(response.output) if done is None else done.outputs
            self.store.put(response, earlier, request.input_items() + outputs,
                           None if done is None else done.json_bytes)
        return response

    def _large(self, request: ResponsesRequest, num_tokens: int) -> bool:
        """Whether a finished reply of `num_tokens` is heavy to build and serialize: its
        logprobs (~80 bytes an entry) past INLINE_BYTES go to a worker thread, as the
        chat API's (20 alternatives of 8,000 tokens held the event loop ~1 s)."""
        return (request.wants_logprobs and logprobs_bytes(request.top_logprobs or 0,
                                                          num_tokens) >= INLINE_BYTES)

    async def _complete(self, request: ResponsesRequest, response_id: str,
                        final: RequestOutput, prepared: PreparedChat,
                        created_at: float | None = None) -> _Done:
        """The finished response, with what storing and sending it needs; built in a
        worker thread when large."""
        def build() -> _Done:
            response = self._finished(request, response_id, final, prepared)
            if created_at is not None:
                response.created_at = created_at
            if not request.wants_logprobs:
                return _Done(response, as_input_items(response.output))
            for item in response.output:  # kept (and sent) as JSON: see OutputText
                for part in item.content if isinstance(item, OutputMessage) else ():
                    part.logprobs_json, part.logprobs = to_json(part.logprobs), []
            return _Done(response, as_input_items(response.output), to_json(response))

        large = self._large(request, len(final.outputs[0].token_ids))
        return await self.offloader.run_in_thread(build) if large else build()

    async def prepare_response(self, request: ResponsesRequest,
                               ) -> tuple[tuple[Any, ...], ChatCompletionRequest, PreparedChat]:
        """(the earlier items it continues, the chat request it becomes, that request
        checked and rendered), truncated as `truncation` allows."""
        earlier = self._earlier_items(request)
        # Off the event loop for a long conversation, as the chat API reads one.
        num_items = len(earlier) + (1 if isinstance(request.input, str)
                                    else len(request.input))
        chat = await self.offloader.run("reading the input", MESSAGE_COST_BYTES * num_items,
                                        request.to_chat_request, earlier)
        try:
            prepared = await self.prepare(chat)
        except ContextLengthError as e:
            if request.truncation != "auto":
                raise
            chat, prepared = await self._truncated(request, earlier, num_items, e)
        return earlier, chat, prepared

    async def create_response(self, request: ResponsesRequest,
                              ) -> ResponseObject | Response | SSEResponse:
        earlier, chat, prepared = await self.prepare_response(request)
        response_id = item_id("resp")
        if request.background and len(self._background) >= self._max_background:
            raise QueueFullError(f"The server is busy: {len(self._background)} background "
                                 f"responses are running (--max-background-responses). "
                                 f"Retry later.")
        streams = self.add_requests(response_id, [(prepared.text, prepared.ids)],
                                    [prepared.params], chat, images=prepared.images)
        if request.background:
            return self._start_background(request, response_id, streams, prepared, earlier)
        if request.stream:
            return SSEResponse(self._events(request, response_id, streams, prepared,
                                            earlier))
        final = await self.final_output(response_id, streams)
        done = await self._complete(request, response_id, final, prepared)
        self._keep(request, done.response, earlier, done)
        if done.body is None:
            return done.response
        return Response(content=done.body, media_type="application/json")

    async def _truncated(self, request: ResponsesRequest, earlier: tuple[Any, ...],
                         num_items: int, too_long: ContextLengthError,
                         ) -> tuple[ChatCompletionRequest, PreparedChat]:
        """truncation "auto": the conversation from the oldest user turn on whose prompt
        fits (a binary search over the turns' starts: fewer items are never longer);
        `too_long`, the whole conversation's error, when even the last turn does not."""
        starts = request.turn_starts(earlier)

        async def attempt(i: int) -> tuple[ChatCompletionRequest, PreparedChat] | None:
            chat = await self.offloader.run(
                "reading the input", MESSAGE_COST_BYTES * (num_items - starts[i]),
                request.to_chat_request, earlier, starts[i])
            try:
                return chat, await self.prepare(chat)
            except ContextLengthError:
                return None

        # The last turn first: when even it does not fit, one short render says so (a
        # search would render half the conversation, then a quarter, ...).
        found = await attempt(len(starts) - 1)
        if found is None:
            raise too_long
        low, high = 0, len(starts) - 2
        while low <= high:
            middle = (low + high) // 2
            fits = await attempt(middle)
            if fits is not None:
                found, high = fits, middle - 1
            else:
                low = middle + 1
        return found

    def _finished(self, request: ResponsesRequest, response_id: str, final: RequestOutput,
                  prepared: PreparedChat) -> ResponseObject:
        """The response of a finished reply: its output items read the chat way."""
        out = final.outputs[0]
        message, finish_reason = self.message_of(
            out, self.reasoning_reader(prepared.phase), prepared.plan.new_reader())
        status = "incomplete" if finish_reason == "length" else "completed"
        output: list[Any] = []
        if message.reasoning:
            output.append(ReasoningItem(id=item_id("rs"), status=status,
                                        content=[ReasoningText(text=message.reasoning)]))
        if message.content or not (message.tool_calls or message.reasoning):
            logprobs = self._text_logprobs(request, out.token_ids, out.logprobs,
                                           bool(message.reasoning))
            output.append(OutputMessage(id=item_id("msg"), status=status, content=[
                OutputText(text=message.content or "", logprobs=logprobs)]))
        for call in message.tool_calls or []:
            output.append(FunctionCallOutput(
                id=item_id("fc"), call_id=call.id, name=call.function.name,
                arguments=call.function.arguments, status="completed"))
        return self._response(request, response_id, output, final, finish_reason,
                              reasoned=bool(message.reasoning))

    # ------------------------------------------------------------------ background

    def _start_background(self, request: ResponsesRequest, response_id: str,
                          streams: list, prepared: PreparedChat, earlier: tuple[Any, ...],
                          ) -> ResponseObject | SSEResponse:
        """Store the response "queued" and run it on in a task; answer it now, or (a
        stream) with the task's events, from its event log (responses_replay.py)."""
        queued = self._keep(request, self._response(request, response_id, [], None, None,
                                                    status="queued"), earlier)
        log = None
        if request.stream:
            log = self._logs[response_id] = EventLog()
        task = asyncio.create_task(self._run_background(
            request, response_id, streams, prepared, earlier, queued, log),
            name=f"background-{response_id}")
        self._background[response_id] = task
        task.add_done_callback(lambda _: self._background.pop(response_id, None))
        return queued if log is None else SSEResponse(log.follow())

    async def _run_background(self, request: ResponsesRequest, response_id: str,
                              streams: list, prepared: PreparedChat,
                              earlier: tuple[Any, ...], queued: ResponseObject,
                              log: EventLog | None) -> None:
        def keep(response: ResponseObject, done: _Done | None = None) -> ResponseObject:
            # Not once deleted (delete() stops tracking it before cancelling).
            response.created_at = queued.created_at
            if response_id in self._background:
                self._keep(request, response, earlier, done)
            return response

        keep(self._response(request, response_id, [], None, None, status="in_progress"))
        try:
            if log is None:
                final = await self.final_output(response_id, streams)
                done = await self._complete(request, response_id, final, prepared,
                                            queued.created_at)
                keep(done.response, done)
            else:
                failures: list[Exception] = []
                async for chunk in self._events(request, response_id, streams, prepared,
                                                earlier, queued, keep, failures.append):
                    log.add(chunk)
                if failures:
                    raise failures[0]
        except asyncio.CancelledError:
            keep(self._response(request, response_id, [], None, None, status="cancelled"))
            raise
        except Exception as e:
            error = ResponseError(code=error_body("", int(error_status(e)))["error"]["type"],
                                  message=exception_message(e))
            keep(self._response(request, response_id, [], None, None, status="failed",
                                error=error))
        finally:
            if log is not None:
                log.finish()
                # Kept with the response (when it still is: not once deleted).
                self._logs.pop(response_id, None)
                if response_id in self._background:
                    self.store.add_events(response_id, tuple(log.events))

    async def cancel(self, response_id: str) -> Any:
        """POST /v1/responses/{id}/cancel: stop a background response; a finished one
        is answered as it is (cancelling is idempotent, as OpenAI's)."""
        assert self.store is not None, "the route exists with the store"
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        stored = self.store.get(response_id)
        if not stored.response.background:
            raise InvalidRequestError(f"Response {response_id[:100]!r} was not created with "
                                      f"background: true, so it cannot be cancelled")
        return await self._send(stored.response, stored.nbytes)

    async def retrieve(self, response_id: str) -> Any:
        """GET /v1/responses/{id}."""
        assert self.store is not None, "the route exists with the store"
        stored = self.store.get(response_id)
        return await self._send(stored.response, stored.nbytes)

    def resume(self, response_id: str, starting_after: int | None) -> SSEResponse:
        """GET /v1/responses/{id}?stream=true: a background stream's events after number
        `starting_after` (all without), followed live while it runs."""
        assert self.store is not None, "the route exists with the store"
        if starting_after is not None and starting_after < -1:
            raise InvalidRequestError(f"starting_after must be a sequence number >= 0, got "
                                      f"{starting_after}")
        start = 0 if starting_after is None else starting_after + 1
        log = self._logs.get(response_id)
        if log is not None:
            return SSEResponse(log.follow(start))
        stored = self.store.get(response_id)
        if not stored.events:
            raise InvalidRequestError(f"Response {response_id[:100]!r} has no stream to "
                                      f"read again: only one created with background: "
                                      f"true and stream: true has")
        return SSEResponse(replay(stored.events, start))

    async def _send(self, response: ResponseObject, nbytes: int) -> Response:
        """`response` as to_json writes it (its logprobs are JSON); in a worker thread
        when large."""
        body = (to_json(response) if nbytes < INLINE_BYTES
                else await self.offloader.run_in_thread(to_json, response))
        return Response(content=body, media_type="application/json")

    def delete(self, response_id: str) -> bool:
        """Drop a stored response; a running background one is cancelled first."""
        assert self.store is not None, "the route exists with the store"
        task = self._background.pop(response_id, None)
        if task is not None:
            task.cancel()
        return self.store.delete(response_id) or task is not None

    async def cancel_background(self) -> None:
        """Cancel every running background response (the server is shutting down)."""
        tasks = list(self._background.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _response(self, request: ResponsesRequest, response_id: str, output: list[Any],
                  final: RequestOutput | None, finish_reason: str | None,
                  reasoned: bool = False, status: ResponseStatus | None = None,
                  error: ResponseError | None = None) -> ResponseObject:
        """The response object: in progress (no `final` yet) or finished with `output`
        (`reasoned`: it holds a reasoning item, whose tokens usage counts); `status`
        given for a background response that has not finished."""
        incomplete = finish_reason == "length"
        status = status or ("in_progress" if final is None else "incomplete" if incomplete
                            else "completed")
        usage = None
        if final is not None:
            out = final.outputs[0]
            num_in, num_out = len(final.prompt_token_ids), len(out.token_ids)
            usage = ResponseUsage(
                input_tokens=num_in, output_tokens=num_out, total_tokens=num_in + num_out,
                input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens),
                output_tokens_details=OutputTokensDetails(
                    reasoning_tokens=self._num_reasoning_tokens(out.token_ids)
                    if reasoned else 0))
        return ResponseObject(
            id=response_id, status=status, model=self.response_model(request.model),
            output=output, usage=usage, background=bool(request.background), error=error,
            incomplete_details=(IncompleteDetails(reason="max_output_tokens")
                                if final is not None and incomplete else None),
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            temperature=request.temperature, top_p=request.top_p,
            tools=[t.model_dump(exclude_none=True) for t in request.tools or []],
            tool_choice=(request.tool_choice.model_dump()
                         if hasattr(request.tool_choice, "model_dump")
                         else request.tool_choice or ("auto" if request.tools else "none")),
            parallel_tool_calls=request.parallel_tool_calls is not False,
            text=(request.text.model_dump(by_alias=True, exclude_none=True)
                  if request.text is not None else {"format": {"type": "text"}}),
            user=request.user, metadata=request.metadata, store=self._stores(request),
            previous_response_id=request.previous_response_id,
            truncation=request.truncation or "disabled",
            reasoning=(request.reasoning.model_dump(exclude={"generate_summary"})
                       if request.reasoning is not None else None))

    def _text_logprobs(self, request: ResponsesRequest, token_ids: list[int],
                       logprobs: list | None, reasoned: bool, start: int = 0,
                       ) -> list[ChatLogprobToken]:
        """The logprobs of the reply's tokens from `start` on, but its reasoning's (none
        unless the request includes them)."""
        if not request.wants_logprobs:
            return []
        if reasoned:
            start = max(start, self._num_reasoning_tokens(token_ids))
        lps = logprobs[start:] if logprobs else None
        content = self.chat_logprobs(token_ids[start:], lps, request.top_logprobs or 0,
                                 self.tokens_as_ids(request)).content
        return content or []

    def _num_reasoning_tokens(self, token_ids: list[int]) -> int:
        """Output tokens up to and including the reasoning's end tag (all of them when
        it never closed)."""
        assert self.reasoning is not None, "reasoning items come from the parser"
        end = self.reasoning.end_id
        return token_ids.index(end) + 1 if end in token_ids else len(token_ids)

    # ------------------------------------------------------------------ streaming

    async def _events(self, request: ResponsesRequest, response_id: str, streams: list,
                      prepared: PreparedChat, earlier: tuple[Any, ...],
                      started: ResponseObject | None = None,
                      keep: Callable[[ResponseObject, _Done], Any] | None = None,
                      failed: Callable[[Exception], None] | None = None,
                      ) -> AsyncIterator[str]:
        """The stream's events. A background one passes its `started` ("queued")
        response, its `keep` (which stores it) and `failed` (told of an error, which
        the stream reports in an error event)."""
        numbers = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            payload = {"type": kind, "sequence_number": next(numbers), **fields}
            return f"event: {kind}\ndata: {fields_json(payload)}\n\n"

        items = ItemStream(event)
        st = ChoiceState(reasoning=self.reasoning_reader(prepared.phase),
                          tools=prepared.plan.new_reader())
        final: RequestOutput | None = None
        finish_reason = None

        def logprobs_since(out: Any) -> list[ChatLogprobToken]:
            """Those of the tokens no text delta has carried yet (st.num_tokens on)."""
            lps = self._text_logprobs(request, out.token_ids, out.logprobs,
                                      items.has_reasoning, st.num_tokens)
            st.num_tokens = len(out.token_ids)
            return lps

        try:
            started = started or self._response(request, response_id, [], None, None)
            yield event("response.created", response=started)
            yield event("response.in_progress",
                        response=started.model_copy(update={"status": "in_progress"}))
            async for _, ro in merge_streams(streams):
                out = ro.outputs[0]
                delta = out.text[st.num_chars:]
                st.num_chars = max(st.num_chars, len(out.text))
                st.is_finished = out.finish_reason is not None
                message, finish_reason = self.delta_of(st, delta, out.finish_reason)
                # A text delta carries the logprobs of the tokens since the last one.
                for chunk in items.feed(message.reasoning or "", message.content or "",
                                        message.tool_calls or [], lambda: logprobs_since(out)):
                    yield chunk
                if st.is_finished:
                    final = ro
            assert final is not None
            out = final.outputs[0]

            def finish() -> tuple[list[str], _Done]:
                """The last items' done events and response.completed: its response,
                status "incomplete" when cut at max_output_tokens, as vLLM's (the SDK's
                stream helper waits for it)."""
                chunks = items.close("incomplete" if finish_reason == "length"
                                     else "completed", logprobs_since(out))
                if request.wants_logprobs and items.has_calls:
                    # As the non-streamed response's: every token after the reasoning (a
                    # reply that went on to a call streamed its call's tokens with no
                    # delta; without calls the deltas carried them all).
                    items.set_text_logprobs(self._text_logprobs(
                        request, out.token_ids, out.logprobs, items.reasoned))
                response = self._response(request, response_id, items.output, final,
                                          finish_reason, reasoned=items.reasoned)
                response.created_at = started.created_at
                chunks.append(event("response.completed", response=response))
                return chunks, _Done(response, as_input_items(response.output),
                                     json_bytes=len(chunks[-1]))

            # Off the loop when large, as _complete.
            chunks, done = (await self.offloader.run_in_thread(finish)
                            if self._large(request, len(out.token_ids)) else finish())
            if keep is None:
                self._keep(request, done.response, earlier, done)
            else:
                keep(done.response, done)
            for chunk in chunks:
                yield chunk
        except Exception as e:
            status = int(error_status(e))
            if failed is not None:
                failed(e)
            yield event("error", message=exception_message(e),
                        code=error_body("", status)["error"]["type"], param=None)
        finally:
            self.abort_all(response_id, 1)


@dataclass
class _Done:
    """A finished response and what storing or sending it needs, measured where it was
    built (off the event loop when large)."""

    response: ResponseObject
    outputs: list[Any]
    """Its output items as input items, for its stored conversation."""
    body: str | None = None
    """Its JSON, when built off the loop."""
    json_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.json_bytes is None and self.body is not None:
            self.json_bytes = len(self.body)

