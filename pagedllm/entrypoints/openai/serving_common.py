"""Shared pieces of the OpenAI handlers: errors, prompt checks, SamplingParams, SSE.

Handlers raise typed exceptions (`InvalidRequestError` -> 400, `ModelNotFoundError` ->
404, `RequestTimeoutError` -> 408, `QueueFullError` and `EngineDeadError` -> 503,
anything else -> 500); server.py maps them to OpenAI's error body. Once a stream has
started, errors travel as a `data: {"error": ...}` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedllm.engine.async_llm import AsyncLLM, QueueFullError
from pagedllm.engine.input_processor import check_num_logprobs, truncate_prompt
from pagedllm.entrypoints.openai.offload import INLINE_BYTES, Offloader
from pagedllm.entrypoints.openai.protocol import (  # noqa: F401  (clamp_logprob: re-exported)
    ChatLogprobs, ChatLogprobTop, ChatLogprobToken, ErrorInfo, ErrorResponse,
    OpenAIBaseModel, PerRequestMetrics, PromptTokenUsageInfo, SamplingFields, UsageInfo,
    clamp_logprob)
from pagedllm.entrypoints.openai.request_logger import RequestLogger
from pagedllm.entrypoints.openai.responses_store import ResponseNotFoundError
from pagedllm.entrypoints.openai.serve_config import ServeConfig
from pagedllm.entrypoints.openai.served_models import ModelNotFoundError, ServedModels
from pagedllm.entrypoints.openai.sliced_json import to_json
from pagedllm.errors import (ContextLengthError, EngineBusyError, EngineDeadError,
                             EngineSleepingError, InvalidRequestError)
from pagedllm.outputs import EmbeddingRequestOutput, Logprob, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import (SamplingParams, StructuredOutputsParams,
                                      check_truncate_prompt_tokens)

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class RequestTimeoutError(Exception):
    """The request reached its deadline (`timeout` / --request-timeout) unfinished: it
    was aborted and its KV blocks freed (408)."""


def error_status(exc: BaseException) -> HTTPStatus:
    if isinstance(exc, (ModelNotFoundError, ResponseNotFoundError)):
        return HTTPStatus.NOT_FOUND
    if isinstance(exc, ValueError):  # InvalidRequestError is one
        return HTTPStatus.BAD_REQUEST
    if isinstance(exc, RequestTimeoutError):
        return HTTPStatus.REQUEST_TIMEOUT
    if isinstance(exc, (EngineDeadError, QueueFullError, EngineSleepingError)):
        return HTTPStatus.SERVICE_UNAVAILABLE
    if isinstance(exc, EngineBusyError):
        return HTTPStatus.CONFLICT
    return HTTPStatus.INTERNAL_SERVER_ERROR


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 408: "TimeoutError", 409: "ConflictError",
                413: "RequestTooLargeError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=_ERROR_TYPES.get(status, HTTPStatus(status).phrase),
                     param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def exception_message(exc: BaseException) -> str:
    if isinstance(exc, EngineDeadError):
        return f"The engine is not running: {exc}"
    return str(exc) or type(exc).__name__


def _constraint(spec: dict[str, Any]) -> StructuredOutputsParams:
    """StructuredOutputsParams(**spec), an unknown field a 400."""
    try:
        return StructuredOutputsParams(**spec)
    except TypeError as e:
        raise InvalidRequestError(f"invalid structured_outputs: {e}") from e


class OpenAIServing:
    """What every handler needs: the engine, the served names, checks and conversions."""

    def __init__(self, engine: AsyncLLM, models: ServedModels,
                 serve_config: ServeConfig, offloader: Offloader) -> None:
        self.engine = engine
        self.models = models
        self.serve_config = serve_config
        self.offloader = offloader
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.request_logger = (
            RequestLogger(serve_config.max_log_len, serve_config.enable_log_requests,
                          serve_config.enable_log_outputs)
            if serve_config.enable_log_requests or serve_config.enable_log_outputs else None)

    @property
    def model_name(self) -> str:
        return self.models.model_name

    def check_model(self, model: str | None) -> None:
        """404 unless `model` (if given) is the base model's or a LoRA adapter's name."""
        self.models.resolve(model)

    def response_model(self, model: str | None) -> str:
        """The `model` a response carries: the adapter's name for an adapter's request
        (as vLLM; check_model passed it, and it stays its name if the adapter is unloaded
        meanwhile), else the base model's first name."""
        if model is None or model in self.models.base_names:
            return self.model_name
        return model

    def check_generation(self) -> None:
        """400 for completions and chat on a model without an LM head, or served with
        the pooling runner."""
        model = self.engine.config.model
        refusal = model.runner_refusal(pooling=False)
        if refusal:
            raise InvalidRequestError(refusal)
        if model.is_encoder_only and model.pooling_task == "embed":
            raise InvalidRequestError(
                f"The model `{self.model_name}` ({model.architecture}) does not support "
                f"generation: it is an embedding model; use /v1/embeddings.")
        if not model.can_generate:
            raise InvalidRequestError(
                f"The model `{self.model_name}` ({model.architecture}) does not support "
                f"generation: it has a classification head; use /score, /rerank or "
                f"/classify.")

    async def json_response(self, build: Callable[[], OpenAIBaseModel], size: int) -> Any:
        """The response `build()` makes; when `size` (its bytes, about) is large, built
        and serialized in a worker thread and sent as bytes. FastAPI would encode the
        returned model on the event loop: 1.4 s for a prompt's logprobs of 8,000 tokens."""
        if size < INLINE_BYTES:
            return build()
        body = await self.offloader.run_in_thread(lambda: build().model_dump_json())
        return Response(content=body, media_type="application/json")

    async def choices_response(self, envelope: Callable[[], OpenAIBaseModel],
                               choices: list[Callable[[], OpenAIBaseModel]],
                               size: int) -> Any:
        """The response `envelope()` makes with `choices` built into its "choices".

        When `size` (its bytes, about) is large, each choice is built and serialized in a
        worker thread and sent as soon as it is, one after the other: built whole, the
        logprobs of 16 samples of 500 tokens at 20 alternatives held the event loop for
        1.3 s and cost ~640 bytes an entry as models (~74 as JSON); 128 samples of 8,000
        tokens would have been 14 GB. Sent this way, one choice is in memory at a time.
        """
        if size < INLINE_BYTES:
            response = envelope()
            response.choices = [build() for build in choices]
            return response

        async def body() -> AsyncIterator[str]:
            head = await self.offloader.run_in_thread(
                lambda: envelope().model_dump_json(exclude={"choices"}))
            yield head[:-1] + ',"choices":['  # head ends with "}"
            for i, build in enumerate(choices):
                part = await self.offloader.run_in_thread(
                    lambda build=build: to_json(build()))  # logprobs a slice at a time
                yield ("," if i else "") + part
            yield "]}"

        return StreamingResponse(body(), media_type="application/json")

    def check_limits(self, request: SamplingFields, num_logprobs: int | None,
                     logprobs_field: str = "logprobs") -> None:
        """The per-request maxima (ServeConfig's n, best_of, stop lists; the engine's
        logprobs); `logprobs_field` names the request's logprobs count (chat:
        top_logprobs)."""
        cfg = self.serve_config
        for name in ("n", "best_of"):
            value = getattr(request, name)
            if value is not None and value > cfg.max_n:
                raise InvalidRequestError(f"{name} must be at most {cfg.max_n} (--max-n), "
                                          f"got {value}.")
        model = self.engine.config.model
        for name, value in ((logprobs_field, num_logprobs),
                            ("prompt_logprobs", request.prompt_logprobs)):
            check_num_logprobs(name, value, model.max_logprobs, model.hf_config.vocab_size)
        if request.prompt_logprobs is not None and request.stream:
            raise InvalidRequestError("prompt_logprobs is not available with stream=true; "
                                      "ask without streaming")
        stop = [request.stop] if isinstance(request.stop, str) else request.stop
        for name, values in (("stop", stop), ("stop_token_ids", request.stop_token_ids),
                             ("bad_words", request.bad_words)):
            if values is not None and len(values) > cfg.max_stop:
                raise InvalidRequestError(f"{name} may have at most {cfg.max_stop} entries "
                                          f"(--max-stop), got {len(values)}.")

    def check_prompt_bytes(self, num_bytes: int, kind: str = "prompt") -> None:
        if num_bytes > self.serve_config.max_prompt_bytes:
            raise InvalidRequestError(
                f"The {kind} has {num_bytes} bytes, more than the "
                f"{self.serve_config.max_prompt_bytes} this server accepts "
                f"(--max-prompt-bytes).")

    async def encode(self, text: str, add_special_tokens: bool = True,
                     check_bytes: bool = True) -> list[int]:
        """Token ids of `text` (off the event loop when large; byte limit checked unless
        the text was checked already, e.g. as a conversation)."""
        num_bytes = len(text.encode("utf-8"))
        if check_bytes:
            self.check_prompt_bytes(num_bytes)
        return await self.offloader.run("tokenizing the prompt", num_bytes,
                                        self.tokenizer.encode, text,
                                        add_special_tokens=add_special_tokens)

    async def check_constraints(self, params: SamplingParams) -> None:
        """Parse a structured-output constraint off the event loop, in the checker's
        child process (constraint_check.py); the input processor's own check then finds
        it remembered."""
        if params.structured_outputs is not None:
            await self.offloader.run_check(self.engine.constraints.check,
                                           params.structured_outputs)

    def truncate(self, text: str | None, ids: list[int], truncate_prompt_tokens: int | None,
                 ) -> tuple[str | None, list[int]]:
        """The prompt as the request's truncate_prompt_tokens leaves it (a truncated one
        loses its text: what is echoed is then its kept tokens' text)."""
        check_truncate_prompt_tokens(truncate_prompt_tokens)
        kept = truncate_prompt(ids, truncate_prompt_tokens, self.max_model_len)
        return (text, ids) if len(kept) == len(ids) else (None, kept)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None,
                     kind: str = "messages") -> int:
        """vLLM's context-length checks; returns the resolved max_tokens."""
        if num_prompt_tokens == 0:
            raise InvalidRequestError("The prompt is empty: give at least one token.")
        if num_prompt_tokens >= self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your request has {num_prompt_tokens} input tokens. Please reduce "
                f"the length of the input {kind}.")
        # The core would reject it too, but only after a stream had started.
        if num_prompt_tokens > self.engine.num_kv_cache_tokens:
            raise ContextLengthError(
                f"The prompt has {num_prompt_tokens} tokens but the KV cache holds only "
                f"{self.engine.num_kv_cache_tokens}. Please reduce the length of the input "
                f"{kind}.")
        if max_tokens is None:
            # The generation config's max_new_tokens, within what the context leaves.
            left = self.max_model_len - num_prompt_tokens
            return min(self.engine.config.model.sampling_defaults.get("max_tokens", left), left)
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                f"({num_prompt_tokens} in the {kind}, {max_tokens} in the completion). "
                f"Please reduce the length of the {kind} or completion.")
        return max_tokens

    async def read_constraint(self, kwargs: dict[str, Any]) -> None:
        """Turn kwargs' structured_outputs (the request's dict) into its
        StructuredOutputsParams in a worker thread: its schema is walked for its depth
        and canonicalized for its cache key, tens of milliseconds each for a large one
        (60,000 properties). The params of a request's prompts then share it, so the
        key is taken once, not once a prompt."""
        spec = kwargs.get("structured_outputs")
        if isinstance(spec, dict):
            kwargs["structured_outputs"] = await self.offloader.run_in_thread(
                _constraint, spec)

    @staticmethod
    def sampling_params(kwargs: dict[str, Any], stream: bool,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams from request fields (None = `defaults`, the model's
        generation-config defaults, else SamplingParams').

        A field this engine does not know is ignored at its neutral value and refused
        otherwise, so a request never silently loses a constraint.
        """
        kw: dict[str, Any] = {k: v for k, v in (defaults or {}).items()
                              if k != "max_tokens"}  # check_length applies that one
        for name, value in kwargs.items():
            if value is None:
                continue
            if name not in _SAMPLING_FIELDS:
                if value in (False, 0, 1, [], {}):
                    continue
                raise InvalidRequestError(f"`{name}` is not supported by this server.")
            kw[name] = value
        if isinstance(kw.get("structured_outputs"), dict):
            kw["structured_outputs"] = _constraint(kw["structured_outputs"])
        if "output_kind" in _SAMPLING_FIELDS:
            from pagedllm.sampling_params import RequestOutputKind

            # Streams diff cumulative outputs (robust to any n / stop-string buffering);
            # non-streaming requests only need the final output.
            kw["output_kind"] = (RequestOutputKind.CUMULATIVE if stream
                                 else RequestOutputKind.FINAL_ONLY)
        return SamplingParams(**kw)

    def _admit(self, prompts: list[tuple[str | None, list[int]]]) -> None:
        """QueueFullError when these prompts would take the server past one of its
        queue limits (each counted in request_rejected_total by its reason)."""
        config, engine = self.serve_config, self.engine
        limit = config.max_queued_requests
        if limit is not None and engine.num_queued + len(prompts) > limit:
            engine.metrics.observe_rejected("queue_full")
            raise QueueFullError(f"The server is busy: {engine.num_queued} requests are "
                                 f"already waiting (--max-queued-requests {limit}). "
                                 f"Retry later.")
        limit = config.max_num_queued_reqs
        if limit is not None and engine.num_in_flight + len(prompts) > limit:
            engine.metrics.observe_rejected("in_flight_full")
            raise QueueFullError(f"The server is busy: {engine.num_in_flight} requests are "
                                 f"in flight (--max-num-queued-reqs {limit}). Retry later.")
        limit = config.max_num_queued_tokens
        if limit is not None:
            pending = engine.num_prefill_tokens
            if pending and pending + sum(len(ids) for _, ids in prompts) > limit:
                engine.metrics.observe_rejected("prefill_tokens_full")
                raise QueueFullError(
                    f"The server is busy: {pending} prompt tokens wait for their prefill "
                    f"(--max-num-queued-tokens {limit}). Retry later.")

    def add_requests(self, request_id: str, prompts: list[tuple[str | None, list[int]]],
                     params: list[SamplingParams], request: SamplingFields,
                     images: list[Any] | None = None, embeds: list[Any] | None = None,
                     ) -> list[AsyncIterator[RequestOutput]]:
        """Submit one engine request per prompt (ids `{request_id}-{i}`); all or none.
        `images` (preprocessed) go with every prompt; `embeds` (tensors) are the
        prompts themselves, whose ids are placeholders.

        QueueFullError when they would take the engine's queue past
        --max-queued-requests.
        """
        self._admit(prompts)
        timeout = request.timeout or self.serve_config.request_timeout
        lora = self.models.resolve(request.model)
        streams = []
        try:
            for i, ((text, ids), sp) in enumerate(zip(prompts, params)):
                prompt = _engine_prompt(text, ids, request, images, embeds[i] if embeds
                                        else None)
                stream = self.engine.add_request(
                    f"{request_id}-{i}", prompt, sp, priority=request.priority,
                    timeout=timeout, lora_request=lora)
                if self.request_logger is not None:
                    stream = self.request_logger.wrap(f"{request_id}-{i}", text, ids, sp,
                                                      lora, stream)
                streams.append(stream)
        except BaseException:
            self.abort_all(request_id, len(streams))
            raise
        return streams

    def check_requests(self, prompts: list[tuple[str | None, list[int]]],
                       params: list[SamplingParams], request: SamplingFields) -> None:
        """What the engine would refuse of these requests (add_requests' checks,
        nothing queued): InvalidRequestError."""
        lora = self.models.resolve(request.model)
        for (text, ids), sp in zip(prompts, params):
            self.engine.engine.check_request(
                _engine_prompt(text, ids, request, None, None), sp,
                priority=request.priority, timeout=request.timeout, lora_request=lora)

    async def run_all(self, request_id: str, prompts: list[tuple[str | None, list[int]]],
                      params: list[Any], request: Any) -> list[Any]:
        """Run one engine request per prompt (`add_requests`), all in flight together;
        each one's final output, in prompt order. Cancelled, or one failing, the others
        are aborted."""
        streams = self.add_requests(request_id, prompts, params, request)
        finals: list[Any] = [None] * len(prompts)
        try:
            async for i, out in merge_streams(streams):
                finals[i] = out
        finally:
            self.abort_all(request_id, len(prompts))  # no-op once every one finished
        return finals

    async def pool_all(self, request_id: str, prompts: list[tuple[str | None, list[int]]],
                       params: list[PoolingParams], request: Any) -> list[list[float]]:
        """Run one pooling (embedding or score) request per prompt, all or none; their
        vectors in prompt order. RequestTimeoutError when one ended without a result."""
        vectors = []
        for out in await self.run_all(request_id, prompts, params, request):
            assert out.finished, "every stream ends finished"
            if out.finish_reason != "stop":
                raise RequestTimeoutError(f"The request ended without a result "
                                          f"({out.finish_reason}).")
            vectors.append(out.outputs.embedding)
        return vectors

    async def pooling_prompt(self, item: str | list[int], truncate_prompt_tokens: int | None,
                             where: str, add_special_tokens: bool = True,
                             ) -> tuple[str | None, list[int]]:
        """One embedding / score / classify input (text or token ids) as (text, ids):
        tokenized, truncated as asked, and checked to fit (400 naming `where`)."""
        if isinstance(item, str):
            ids = await self.encode(item, add_special_tokens) if item else []
            prompt = self.truncate(item, ids, truncate_prompt_tokens)
        else:
            prompt = self.truncate(None, list(item), truncate_prompt_tokens)
        self.check_pooling_length(len(prompt[1]), where)
        return prompt

    def check_pooling_length(self, num_tokens: int, where: str) -> None:
        """An embedding or score input fits one step and the KV cache; 400 naming it."""
        if num_tokens == 0:
            raise InvalidRequestError(f"{where} is empty: give at least one token")
        if num_tokens > self.max_model_len:
            # vLLM's message for embedding inputs.
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_tokens} tokens in the input for embedding "
                f"generation ({where}). Please reduce the length of the input.")
        max_batched = self.engine.config.scheduler.step_budget
        if num_tokens > max_batched:
            raise InvalidRequestError(
                f"{where} has {num_tokens} tokens, but an embedding input is computed in "
                f"one step of at most {max_batched} tokens (--max-num-batched-tokens).")
        if num_tokens > self.engine.num_kv_cache_tokens:
            raise InvalidRequestError(
                f"{where} has {num_tokens} tokens but the KV cache holds only "
                f"{self.engine.num_kv_cache_tokens}.")

    def abort_all(self, request_id: str, num_prompts: int) -> None:
        for i in range(num_prompts):
            self.engine.abort(f"{request_id}-{i}")

    # ------------------------------------------------------------------ logprobs

    def usage(self, num_prompt: int, num_completion: int, num_cached: int) -> UsageInfo:
        """The usage block; with --enable-prompt-tokens-details its cached tokens."""
        details = (PromptTokenUsageInfo(cached_tokens=num_cached)
                   if self.serve_config.enable_prompt_tokens_details else None)
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                         total_tokens=num_prompt + num_completion,
                         prompt_tokens_details=details)

    def timing(self, finals: list[RequestOutput], num_generated: int,
               ) -> PerRequestMetrics | None:
        """A response's `metrics` with --enable-per-request-metrics (else None), over
        its requests (several prompts: from the first one scheduled to the last token
        of any)."""
        if not self.serve_config.enable_per_request_metrics:
            return None
        return per_request_metrics([ro.metrics for ro in finals], num_generated)

    def tokens_as_ids(self, request: Any) -> bool:
        """Whether a request's logprobs name tokens by id (its field, else the flag)."""
        asked = getattr(request, "return_tokens_as_token_ids", None)
        return self.serve_config.return_tokens_as_token_ids if asked is None else asked

    def token_text(self, token_id: int, logprob: Logprob | None = None,
                   as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def chat_logprobs(self, token_ids: list[int], logprobs: list | None,
                      num_top: int | list[int], as_ids: bool = False) -> ChatLogprobs:
        """Chat's logprobs of `token_ids` (each token's text, bytes and top
        alternatives: the `num_top` most likely, or a list's tokens in its order
        (logprob_token_ids)). `as_ids`: tokens named "token_id:<id>"
        (return_tokens_as_token_ids)."""
        content = []
        for k, token_id in enumerate(token_ids):
            step: dict[int, Logprob] | None = logprobs[k] if logprobs and k < len(
                logprobs) else None
            chosen = step.get(token_id) if step else None
            token = self.token_text(token_id, chosen, as_ids)
            top = []
            if step and isinstance(num_top, list):
                top = [self._chat_top(t, step[t], as_ids) for t in num_top if t in step]
            elif step:
                ranked = sorted((lp.rank, t, lp) for t, lp in step.items()
                                if lp.rank is not None and lp.rank <= num_top)
                top = [self._chat_top(t, lp, as_ids) for _, t, lp in ranked[:num_top]]
            content.append(ChatLogprobToken(
                token=token, logprob=clamp_logprob(chosen.logprob) if chosen else -9999.0,
                bytes=list(token.encode("utf-8")), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _chat_top(self, token_id: int, lp: Logprob, as_ids: bool) -> ChatLogprobTop:
        token = self.token_text(token_id, lp, as_ids)
        return ChatLogprobTop(token=token, logprob=clamp_logprob(lp.logprob),
                              bytes=list(token.encode("utf-8")))


def _engine_prompt(text: str | None, ids: list[int], request: SamplingFields,
                   images: list[Any] | None, embeds: Any) -> dict[str, Any]:
    """The engine's prompt dict of one prompt of an API request."""
    prompt: dict[str, Any] = ({"prompt_embeds": embeds} if embeds is not None
                              else {"prompt": text, "prompt_token_ids": ids})
    if images:
        prompt["multi_modal_data"] = {"image": images}
    if getattr(request, "cache_salt", None) is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt


def logprobs_bytes(k: int | None, num_tokens: int) -> int:
    """About the bytes the logprobs of `num_tokens` generated tokens add to a response
    (k + 1 entries of ~80 bytes a token); 0 when not asked."""
    return 0 if k is None else num_tokens * (k + 1) * 80


def prompt_logprobs_bytes(k: int | None, n: int, num_prompt_tokens: int) -> int:
    """About the bytes prompt_logprobs add to a response (k + 1 entries of ~64 bytes per
    prompt token, in each of n choices); 0 when not asked."""
    return 0 if k is None else num_prompt_tokens * (k + 1) * 64 * n


async def merge_streams(streams: list[AsyncIterator[RequestOutput]],
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output), in arrival order.

    Closing the merged iterator (or cancelling its consumer) closes every stream, which
    aborts their unfinished requests. A request that reached its deadline raises
    RequestTimeoutError (the engine has already aborted it).
    """
    # Bounded: while the consumer is not reading (a client not reading its stream), each
    # pump waits with one output in hand and the rest merge in the request's collector
    # (AsyncLLM) instead of piling up here.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, done))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            elif item.finished and _timed_out(item):
                num_tokens = (0 if isinstance(item, EmbeddingRequestOutput)
                              else sum(len(o.token_ids) for o in item.outputs))
                raise RequestTimeoutError(
                    f"The request timed out: it was still running at its deadline "
                    f"(`timeout`, or the server's --request-timeout) after {num_tokens} "
                    f"generated tokens, and was aborted.")
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _timed_out(out: RequestOutput | EmbeddingRequestOutput) -> bool:
    if isinstance(out, EmbeddingRequestOutput):
        return out.finish_reason == "timeout"
    return any(o.finish_reason == "timeout" for o in out.outputs)


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(exc: BaseException) -> str:
    status = int(error_status(exc))
    return sse(json.dumps(error_body(exception_message(exc), status)))


KEEP_ALIVE = ": keep-alive\n\n"


async def with_keep_alive(content: AsyncIterator[str], interval_s: float,
                          ) -> AsyncIterator[str]:
    """`content`'s events, and KEEP_ALIVE after every `interval_s` without one. The next
    event is awaited in a task that outlives each wait (a timeout must not cancel the
    generator midway); closing this closes `content`."""
    events = content.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield event
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


class SSEResponse(StreamingResponse):
    """Server-sent events that stop (and close their generator) when the client leaves.

    Starlette notices a disconnect only when a send fails; a slow generation could keep
    a gone client's request running. Here a listener races the stream and cancels it.
    """

    def __init__(self, content: AsyncIterator[str], keep_alive_s: float = 0.0) -> None:
        """`keep_alive_s` > 0 (--sse-keep-alive-interval): an SSE comment whenever the
        stream has sent nothing for that long, so that proxies with read timeouts keep
        the connection while the request waits, prefills or decodes slowly."""
        if keep_alive_s > 0:
            content = with_keep_alive(content, keep_alive_s)
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.create_task(self.stream_response(send))
        listener = asyncio.create_task(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listener):
                task.cancel()
            await asyncio.gather(stream, listener, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            if not isinstance(stream.exception(), OSError):  # the client went away
                raise stream.exception()


def per_request_metrics(stamps: list[dict[str, float]], num_generated: int,
                        ) -> PerRequestMetrics:
    """vLLM's per-request timing from RequestOutput.metrics timestamps (the earliest
    start and the latest end over several requests), in ms."""
    def first(name: str) -> float | None:
        return min((s[name] for s in stamps if name in s), default=None)

    arrival, scheduled = first("arrival_time"), first("first_scheduled_time")
    first_token = first("first_token_time")
    last_token = max((s["last_token_time"] for s in stamps if "last_token_time" in s),
                     default=None)
    m = PerRequestMetrics()
    if arrival is not None and scheduled is not None:
        m.queue_time_ms = max(scheduled - arrival, 0.0) * 1000
    if scheduled is not None and first_token is not None:
        m.time_to_first_token_ms = max(first_token - scheduled, 0.0) * 1000
    if first_token is not None and last_token is not None:
        m.generation_time_ms = (last_token - first_token) * 1000
        if num_generated > 1:
            m.mean_itl_ms = m.generation_time_ms / (num_generated - 1)
    if scheduled is not None and last_token is not None and last_token > scheduled:
        m.tokens_per_second = num_generated / (last_token - scheduled)
    return m
