"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncLLM.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (and vLLM's
/v1/chat/completions/batch: several conversations, a choice each),
POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, its errors
in Anthropic's form; the API key also as x-api-key), POST /v1/chat/completions/render,
/v1/completions/render, /v1/messages/render and /v1/responses/render (vLLM's: the
/inference/v1/generate body a request renders to), POST /v1/responses (OpenAI's
Responses API; with --enable-responses-store also
GET / DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items and
POST /v1/responses/{id}/cancel), GET /v1/models/{id},
POST /v1/embeddings (and Cohere's /v2/embed), POST /pooling, GET|POST /ping and POST
/invocations (SageMaker's),
POST /score, /rerank and /classify (vLLM's; also under /v1, /v2/rerank), POST
/generative_scoring (vLLM's: label tokens' probabilities after query + item),
POST /tokenize, POST /detokenize, GET /tokenizer_info, GET|HEAD /health, GET /version, GET /metrics,
GET /debug/stats, with --enable-sleep-mode POST /sleep, POST /wake_up and GET
/is_sleeping, with --profiler-dir POST /start_profile and /stop_profile, with
--enable-dev-endpoints POST /pause, /resume, GET /is_paused and POST /collective_rpc
(vLLM's),
GET /dashboard (a live page; its files need no key, its feed
GET /dashboard/state is keyed like /metrics: dashboard/routes.py).
Errors use OpenAI's body ({"error": {message, type, param, code}}, plus vLLM's
"object": "error"): 400 for invalid parameters (FastAPI's 422 included), 401 for a
missing or wrong API key (every route but /health, and /metrics with
--metrics-without-key), 404 for an unknown model, 408 for a request past its deadline,
413 for a body over --max-body-bytes, 503 with Retry-After when the queue is full
(--max-queued-requests) and 503 once the engine process is gone. /health never waits on
the engine: it checks the process. Limits and policies: serve_config.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import inspect
import json
import logging
import os
import socket
import stat
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineProcess
from pagedllm.entrypoints.openai.protocol import (BatchChatCompletionRequest,
                                                  ChatCompletionRequest,
                                                  CollectiveRPCRequest, CompletionRequest,
                                                  DetokenizeRequest, DetokenizeResponse,
                                                  LoadLoRAAdapterRequest, ModelCard,
                                                  ModelList, TokenizeRequest,
                                                  TokenizeResponse, UnloadLoRAAdapterRequest)
from pagedllm.engine.async_llm import QueueFullError
from pagedllm.entrypoints.openai.dashboard import (PAGE_PATHS, STATE_PATH, DashboardFeed,
                                                   add_dashboard_routes)
from pagedllm.entrypoints.openai.connections import (ConnectionGuard, default_max_connections,
                                                     raise_open_file_limit)
from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.anthropic.serving import AnthropicServingMessages
from pagedllm.entrypoints.openai.embedding_protocol import (CohereEmbedRequest, EmbeddingRequest,
                                                            PoolingRequest)
from pagedllm.entrypoints.openai.generate_protocol import AbortRequest, GenerateRequest
from pagedllm.entrypoints.openai.middleware import (APIKeyMiddleware, BodyLimitMiddleware,
                                                    LoadMiddleware, RequestIdMiddleware,
                                                    ServerLoad, error_response)
from pagedllm.entrypoints.openai.responses_protocol import ResponseObject, ResponsesRequest
from pagedllm.entrypoints.openai.responses_store import (ResponseNotFoundError,
                                                         list_input_items)
from pagedllm.entrypoints.openai.score_protocol import (ClassifyRequest, RerankRequest,
                                                       ScoreRequest)
from pagedllm.entrypoints.openai.offload import INLINE_BYTES, Offloader
from pagedllm.entrypoints.openai.request_body import BodyRoutes, JSONObject, validate_body
from pagedllm.entrypoints.openai.serve_config import ServeConfig
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_chat_batch import (
    create_batch_chat_completion as run_chat_batch)
from pagedllm.entrypoints.openai.served_models import (ModelNotFoundError, ServedModels,
                                                       parse_lora_module)
from pagedllm.entrypoints.openai.serving_common import (RequestTimeoutError, error_status,
                                                        exception_message)
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_generate import (GENERATE_ID_PREFIX,
                                                          OpenAIServingGenerate)
from pagedllm.entrypoints.openai.serving_generative_scoring import (
    GenerativeScoringRequest, OpenAIServingGenerativeScoring)
from pagedllm.entrypoints.openai.serving_render import OpenAIServingRender
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore
from pagedllm.errors import (ConfigError, EngineBusyError, EngineDeadError,
                             EngineSleepingError, InvalidRequestError)
from pagedllm.qualname import import_by_name
from pagedllm.sample.constraint_check import ConstraintChecker

logger = logging.getLogger(__name__)

# Seconds a full queue asks clients to wait before retrying.
RETRY_AFTER_S = 1
# Seconds after SIGTERM/SIGINT before the process exits whatever still runs.
SHUTDOWN_GRACE_S = 7.0


# Errors named in a 400's message; the rest only make it longer.
MAX_ERRORS_SHOWN = 8
# The routes that read or write text: a server without a tokenizer refuses them.
TEXT_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/pooling",
               "/v1/responses", "/score", "/v1/score", "/classify", "/v1/classify",
               "/rerank", "/v1/rerank", "/v2/rerank", "/invocations", "/tokenize",
               "/detokenize", "/tokenizer_info", "/v1/messages", "/v1/messages/count_tokens",
               "/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
               "/v1/chat/completions/batch", "/v2/embed", "/v1/responses/render")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's (first few) errors, and the offending field."""
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error")
            return "Invalid JSON in the request body" + (f": {reason}" if reason else ""), None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if not loc and err.get("type") == "model_attributes_type":
            # A body FastAPI did not parse as JSON: no JSON Content-Type.
            return ("The request body must be a JSON object sent with Content-Type: "
                    "application/json"), None
        if loc and param is None:
            param = loc[-1] if err.get("type") == "extra_forbidden" else loc[0]
        if err.get("type") == "extra_forbidden":
            parts.append(f"Unrecognized request field `{'.'.join(loc)}`: this server does "
                         f"not implement it")
            continue
        # A ValueError raised by a validator reads "Value error, <our message>".
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return "; ".join(parts[:MAX_ERRORS_SHOWN]) or "invalid request", param


async def _cancel_on_disconnect(raw_request: Request, work: Awaitable[Any]) -> Any:
    """Run a non-streaming handler; cancel it (aborting its requests) if the client
    disconnects first."""
    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    handler = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({handler, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not handler.done():
            handler.cancel()
            logger.info("client disconnected; request cancelled")
            with contextlib.suppress(asyncio.CancelledError):
                await handler
            return Response(status_code=499)
    return handler.result()


def build_app(engine: AsyncLLM, served_model_names: list[str],
              api_key: str | None = None, shutdown_engine: bool = False,
              serve_config: ServeConfig | None = None,
              lora_modules: list[tuple[str, str]] = (),
              root_path: str | None = None, middleware: list[Any] = ()) -> FastAPI:
    """The FastAPI app; with `shutdown_engine` the app's shutdown stops the engine.
    `lora_modules`: (name, path) of the LoRA adapters served from the start (checked
    now: InvalidRequestError for one that cannot run). `root_path`: the prefix a proxy
    serves it under. `middleware`: the user's (--middleware, import_middleware's), inside
    the server's own."""
    from pagedllm import __version__

    serve_config = serve_config or ServeConfig()
    lora_on = engine.config.lora is not None
    if (lora_modules or serve_config.allow_runtime_lora_updating) and not lora_on:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need "
                         "--enable-lora")
    models = ServedModels(served_model_names,
                          engine.engine.input_processor.check_lora if lora_on else None)
    for name, path in lora_modules:
        models.add(name, path)
    offloader = Offloader(serve_config.render_timeout)
    dashboard = DashboardFeed(engine, served_model_names[0])

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The dashboard's history (front-end counters, once a second).
        sampler = asyncio.create_task(dashboard.run_sampler(), name="dashboard-sampler")
        # The constraint checker's process (importing xgrammar: seconds) starts now,
        # not when the first structured-output request waits for it.
        offloader.start_check(engine.constraints.warm_up)
        yield
        sampler.cancel()
        if responses is not None:
            await responses.cancel_background()
        offloader.shutdown()
        if shutdown_engine:
            # Here, not after uvicorn returns: on SIGTERM uvicorn re-raises the signal
            # once it has shut down, which would end the process first.
            engine.shutdown()

    docs: dict[str, Any] = ({"docs_url": None, "redoc_url": None, "openapi_url": None}
                            if serve_config.disable_fastapi_docs else {})
    app = FastAPI(title="pagedllm OpenAI-compatible server", version=__version__,
                  lifespan=lifespan, root_path=root_path or "", **docs)
    _install_error_handlers(app, serve_config.log_error_stack)
    for extra in middleware:  # added first: innermost, after the server's checks
        if isinstance(extra, type):
            app.add_middleware(extra)
        else:
            app.middleware("http")(extra)
    # Added last = outermost: the body limit applies before anything reads the body.
    if api_key:
        open_paths = {"/health", "/ping"} | PAGE_PATHS | (
            {"/metrics", STATE_PATH} if serve_config.metrics_without_key else set())
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=open_paths)
    app.add_middleware(BodyLimitMiddleware, max_bytes=serve_config.max_body_bytes,
                       read_timeout=serve_config.read_timeout)
    if serve_config.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    load = ServerLoad()
    if serve_config.enable_server_load_tracking:
        app.add_middleware(LoadMiddleware, load=load)

    @app.get("/load")
    async def server_load() -> dict[str, int]:
        """Requests in flight (0 unless --enable-server-load-tracking), as vLLM's."""
        return {"server_load": load.value}

    # Outermost: browsers' preflight requests are answered before the key check, and
    # every answer (401 and 413 included) carries the CORS headers.
    app.add_middleware(CORSMiddleware, allow_origins=serve_config.allowed_origins,
                       allow_methods=serve_config.allowed_methods,
                       allow_headers=serve_config.allowed_headers,
                       allow_credentials=serve_config.allow_credentials)
    _add_engine_routes(app, engine, __version__)
    if serve_config.enable_dev_endpoints:
        _add_dev_routes(app, engine)
    responses = _add_openai_routes(app, engine, models, serve_config, offloader)
    add_dashboard_routes(app, dashboard)
    return app


def _add_engine_routes(app: FastAPI, engine: AsyncLLM, version_str: str) -> None:
    """Health, version, metrics and debug state: they never wait on a batch."""

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        try:
            engine.check_health()
        except EngineDeadError as e:
            return error_response(exception_message(e), 503)
        return Response(status_code=200)

    # SageMaker's health check (with /invocations below), as vLLM serves it.
    app.api_route("/ping", methods=["GET", "POST"])(health)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": version_str}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_external: bool = False) -> Response:
        """Forget the prefix cache's blocks (vLLM's route, e.g. between benchmark runs):
        200, or 409 while requests hold blocks (with data parallel replicas: every one
        reset, else 409). `?reset_external=true` (vLLM's): also delete this model's
        blocks from the KV store of --kv-transfer-config."""
        if await engine.call_utility("reset_prefix_cache", reset_external):
            return Response(status_code=200)
        return error_response("the prefix cache cannot be reset while requests are "
                              "running: retry once they finish", 409)

    if engine.config.device.enable_sleep_mode:
        @app.post("/sleep")
        async def sleep(level: int = 1) -> Response:
            """vLLM's: release the KV cache (level 1) or the weights too (level 2) of an
            idle engine; requests get 503 until /wake_up."""
            await engine.sleep(level)
            return Response(status_code=200)

        @app.post("/wake_up")
        async def wake_up(tags: list[str] | None = Query(None)) -> Response:
            """Take back what /sleep released (?tags=weights&tags=kv_cache: default
            both, the weights first)."""
            await engine.wake_up(tags)
            return Response(status_code=200)

        @app.get("/is_sleeping")
        async def is_sleeping() -> dict[str, bool]:
            return {"is_sleeping": await engine.is_sleeping()}

    if engine.config.device.profiler_dir is not None:
        @app.post("/start_profile")
        async def start_profile() -> Response:
            """vLLM's: record the engine's steps with torch's profiler."""
            await engine.start_profile()
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> dict[str, list[str]]:
            """Stop recording; the traces written (one per worker)."""
            return {"traces": await engine.stop_profile()}

    @app.get("/debug/stats")
    async def debug_stats() -> dict[str, Any]:
        """The core's scheduler and KV-cache state (tests check that aborts free blocks)."""
        import psutil

        stats = await engine.call_utility("get_stats")
        return stats | {"num_front_end_requests": len(engine.core_client.requests),
                        "api_rss_bytes": psutil.Process().memory_info().rss}


def _add_openai_routes(app: FastAPI, engine: AsyncLLM, models: ServedModels,
                       serve_config: ServeConfig, offloader: Offloader,
                       ) -> OpenAIServingResponses | None:
    """The OpenAI routes; returns the Responses handler (shutdown cancels its
    background responses), None where the server has only the Tokens In<>Out ones."""
    # A model card's `created`: when this server began serving (the same in every
    # answer: a listing and a retrieve a second apart once disagreed).
    created = int(time.time())

    def model_cards() -> list[ModelCard]:
        cards = [ModelCard(id=name, root=engine.config.model.path, created=created,
                           max_model_len=engine.max_model_len) for name in models.base_names]
        return cards + [ModelCard(id=lora.lora_name, root=lora.lora_path, created=created,
                                  parent=models.model_name,
                                  max_model_len=engine.max_model_len) for lora in models]

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=model_cards())

    # OpenAI's retrieve (`client.models.retrieve(name)`); a name with "/" (org/model)
    # is one path parameter.
    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> ModelCard:
        for card in model_cards():
            if card.id == model:
                return card
        models.resolve(model)  # raises its 404
        raise AssertionError("every resolvable name has a card")

    if serve_config.allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            # The check reads the adapter's files: off the event loop.
            await asyncio.to_thread(models.add, request.lora_name, request.lora_path)
            return Response(f"Success: LoRA adapter '{request.lora_name}' added "
                            f"successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            models.remove(request.lora_name)
            return Response(f"Success: LoRA adapter '{request.lora_name}' removed "
                            f"successfully.", media_type="text/plain")

    post = BodyRoutes(app, offloader).post
    _add_generate_routes(app, post,
                         OpenAIServingGenerate(engine, models, serve_config, offloader))
    if serve_config.tokens_only:
        return None
    if engine.tokenizer is None:
        _refuse_text_routes(app)
        return None
    completions = OpenAIServingCompletion(engine, models, serve_config, offloader)
    chat = OpenAIServingChat(engine, models, serve_config, offloader)
    embeddings = OpenAIServingEmbedding(engine, models, serve_config, offloader)
    scores = OpenAIServingScore(engine, models, serve_config, offloader)
    responses = OpenAIServingResponses(engine, models, serve_config, offloader)
    messages = AnthropicServingMessages(engine, models, serve_config, offloader)
    generative_scoring = OpenAIServingGenerativeScoring(engine, models, serve_config,
                                                        offloader)

    @post("/v1/completions", body=CompletionRequest)
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        _take_header_request_id(request, raw_request, "cmpl")
        if request.stream:
            return await completions.create_completion(request)
        return await _cancel_on_disconnect(raw_request, completions.create_completion(request))

    @post("/v1/chat/completions", body=ChatCompletionRequest)
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Any:
        _take_header_request_id(request, raw_request, "chatcmpl")
        if request.stream:
            return await chat.create_chat_completion(request)
        return await _cancel_on_disconnect(raw_request, chat.create_chat_completion(request))

    @post("/v1/chat/completions/batch", body=BatchChatCompletionRequest)
    async def create_batch_chat_completion(request: BatchChatCompletionRequest,
                                           raw_request: Request) -> Any:
        _take_header_request_id(request, raw_request, "chatcmpl")
        return await _cancel_on_disconnect(raw_request, run_chat_batch(chat, request))

    @post("/generative_scoring", body=GenerativeScoringRequest)
    async def create_generative_scoring(request: GenerativeScoringRequest,
                                        raw_request: Request) -> Any:
        _take_header_request_id(request, raw_request, "generative-scoring")
        return await _cancel_on_disconnect(
            raw_request, generative_scoring.create_generative_scoring(request))

    @post("/v1/embeddings", body=EmbeddingRequest)
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Any:
        return await _cancel_on_disconnect(raw_request,
                                           embeddings.create_embedding(request))

    @post("/v2/embed", body=CohereEmbedRequest)
    async def create_cohere_embedding(request: CohereEmbedRequest, raw_request: Request,
                                      ) -> Any:
        return await _cancel_on_disconnect(raw_request,
                                           embeddings.create_cohere_embedding(request))

    @post("/pooling", body=PoolingRequest)
    async def create_pooling(request: PoolingRequest, raw_request: Request) -> Any:
        return await _cancel_on_disconnect(raw_request, embeddings.create_pooling(request))

    @post("/v1/responses", body=ResponsesRequest)
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Any:
        if request.stream:
            return await responses.create_response(request)
        return await _cancel_on_disconnect(raw_request, responses.create_response(request))

    if responses.store is not None:
        store = responses.store

        @app.get("/v1/responses/{response_id}", response_model=ResponseObject)
        async def retrieve_response(response_id: str, stream: bool = False,
                                    starting_after: int | None = None) -> Any:
            if stream:  # OpenAI's resumable background streams
                return responses.resume(response_id, starting_after)
            return await responses.retrieve(response_id)

        @app.get("/v1/responses/{response_id}/input_items")
        async def list_response_input_items(response_id: str, after: str | None = None,
                                            before: str | None = None, limit: int = 20,
                                            order: str = "desc") -> dict[str, Any]:
            # `include` is accepted and needs nothing: stored items keep every field.
            return list_input_items(store.get(response_id), after, before, limit, order)

        @app.delete("/v1/responses/{response_id}")
        async def delete_response(response_id: str) -> dict[str, Any]:
            if not responses.delete(response_id):
                store.get(response_id)  # raises its 404
            return {"id": response_id, "object": "response", "deleted": True}

        @app.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject)
        async def cancel_response(response_id: str) -> Any:
            return await responses.cancel(response_id)

    @post("/v1/messages", body=MessagesRequest)
    async def create_message(request: MessagesRequest, raw_request: Request) -> Any:
        given = raw_request.headers.get("x-request-id")
        if request.request_id is None and given:
            request.request_id = f"msg_{given[:128]}"
        if request.stream:
            return await messages.create_message(request)
        return await _cancel_on_disconnect(raw_request, messages.create_message(request))

    @post("/v1/messages/count_tokens", body=CountTokensRequest)
    async def count_message_tokens(request: CountTokensRequest, _: Request) -> Any:
        return await messages.count_tokens(request)

    render = OpenAIServingRender(chat, completions, responses)

    @post("/v1/chat/completions/render", body=ChatCompletionRequest)
    async def render_chat_completion(request: ChatCompletionRequest, _: Request) -> Any:
        return await render.render_chat(request)

    @post("/v1/completions/render", body=CompletionRequest)
    async def render_completion(request: CompletionRequest, _: Request) -> Any:
        return await render.render_completion(request)

    @post("/v1/messages/render", body=MessagesRequest)
    async def render_message(request: MessagesRequest, _: Request) -> Any:
        return await render.render_messages(request)

    @post("/v1/responses/render", body=ResponsesRequest)
    async def render_response(request: ResponsesRequest, _: Request) -> Any:
        return await render.render_response(request)

    @post("/score", "/v1/score", body=ScoreRequest)
    async def create_score(request: ScoreRequest, raw_request: Request) -> Any:
        return await _cancel_on_disconnect(raw_request, scores.create_score(request))

    @post("/classify", "/v1/classify", body=ClassifyRequest)
    async def create_classify(request: ClassifyRequest, raw_request: Request) -> Any:
        return await _cancel_on_disconnect(raw_request, scores.create_classify(request))

    @post("/rerank", "/v1/rerank", "/v2/rerank", body=RerankRequest)
    async def create_rerank(request: RerankRequest, raw_request: Request) -> Any:
        return await _cancel_on_disconnect(raw_request, scores.create_rerank(request))

    # SageMaker's one inference route, as vLLM's: the body's keys say which API it is for.
    invocation_routes: list[tuple[tuple[str, ...], type, Any]] = [
        (("messages",), ChatCompletionRequest, create_chat_completion),
        (("prompt", "prompt_embeds"), CompletionRequest, create_completion),
        (("query",), RerankRequest, create_rerank),
        (("text_1", "queries"), ScoreRequest, create_score),
        (("input",), EmbeddingRequest, create_embedding)]

    @post("/invocations", body=JSONObject)
    async def invocations(request: JSONObject, raw_request: Request) -> Any:
        body = request.root
        for keys, model, handler in invocation_routes:
            if any(key in body for key in keys):
                # Off the event loop when large, as every route's body (request_body.py).
                typed = (validate_body(body, model)
                         if len(await raw_request.body()) < INLINE_BYTES
                         else await offloader.run_in_thread(validate_body, body, model))
                return await handler(typed, raw_request)
        raise InvalidRequestError(
            "the body names no API: it needs messages (chat), prompt or prompt_embeds "
            "(completions), query (rerank), text_1 or queries (score) or input "
            "(embeddings)")

    @post("/tokenize", body=TokenizeRequest, response_model=TokenizeResponse)
    async def tokenize(request: TokenizeRequest, _: Request) -> TokenizeResponse:
        chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages")
        if request.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in request.tools or ()]
            ids = await chat.prompt_token_ids(
                request.messages, request.add_generation_prompt,
                request.continue_final_message, request.chat_template,
                request.chat_template_kwargs, tools)
        else:
            ids = await chat.encode(request.prompt, request.add_special_tokens)
        strs = (engine.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs
                else None)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len,
                                tokens=ids, token_strs=strs)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """The tokenizer's configuration, as tokenizer_config.json holds it (vLLM's
        /tokenizer_info: harnesses set up a client-side tokenizer from it)."""
        return tokenizer_info_of(engine.tokenizer, engine.max_model_len)

    @post("/detokenize", body=DetokenizeRequest, response_model=DetokenizeResponse)
    async def detokenize(request: DetokenizeRequest, _: Request) -> DetokenizeResponse:
        chat.check_model(request.model)
        vocab_size = engine.config.model.hf_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids out of vocabulary (size {vocab_size}): "
                                      f"{bad[:5]}")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(request.tokens))

    return responses


def _add_generate_routes(app: FastAPI, post: Any, generate: OpenAIServingGenerate) -> None:
    """vLLM's Tokens In<>Out routes: /inference/v1/generate and the abort of its
    requests by id (also at /abort_requests, vLLM's path for --tokens-only servers)."""

    @post("/inference/v1/generate", body=GenerateRequest)
    async def generate_tokens(request: GenerateRequest, raw_request: Request) -> Any:
        given = (request.request_id or raw_request.headers.get("x-request-id", "")[:128]
                 or uuid.uuid4().hex)
        request_id = GENERATE_ID_PREFIX + given
        if request.stream:
            return await generate.generate(request, request_id)
        return await _cancel_on_disconnect(raw_request,
                                           generate.generate(request, request_id))

    @post("/inference/v1/abort_requests", "/abort_requests", body=AbortRequest)
    async def abort_requests(request: AbortRequest, _: Request) -> Response:
        """Abort these requests (by the response's request_id, or the caller's own);
        an id that is not running is no error."""
        for given in request.request_ids:
            for request_id in {given, GENERATE_ID_PREFIX + given}:
                generate.abort_all(request_id, 1)
        return Response(status_code=200)


def _add_dev_routes(app: FastAPI, engine: AsyncLLM) -> None:
    """vLLM's development routes (--enable-dev-endpoints): pause and resume generation,
    collective_rpc on the workers."""

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True) -> dict[str, str]:
        """?mode=abort (the requests in flight end), wait (they finish first: answered
        then) or keep (they go on at /resume); new requests wait meanwhile."""
        await engine.pause_generation(mode, clear_cache)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict[str, str]:
        await engine.resume_generation()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": await engine.is_paused()}

    @app.post("/collective_rpc")
    async def collective_rpc(request: CollectiveRPCRequest) -> dict[str, Any]:
        """Each rank's result, as JSON (other values as their str(), as vLLM's)."""
        try:
            results = await engine.collective_rpc(request.method, timeout=request.timeout,
                                                  args=tuple(request.args),
                                                  kwargs=request.kwargs)
        except TimeoutError:
            raise RequestTimeoutError(f"collective_rpc {request.method!r} did not answer "
                                      f"within {request.timeout:g} s (the call runs on in "
                                      f"the workers)") from None
        except (EngineBusyError, EngineDeadError):
            raise
        except Exception as e:  # the call's own failure (no such method, it raised)
            raise InvalidRequestError(f"collective_rpc {request.method!r} failed: "
                                      f"{type(e).__name__}: {e}") from e
        plain = (type(None), dict, list, str, int, float, bool)
        return {"results": [r if isinstance(r, plain) else str(r) for r in results]}


def _refuse_text_routes(app: FastAPI) -> None:
    """A server without a tokenizer answers the routes that need one with a 400 that
    says why (with --tokens-only they are not served at all: 404, as vLLM's)."""
    async def refuse(_: Request) -> Response:
        raise InvalidRequestError(
            "this server loads no tokenizer (--skip-tokenizer-init): only the Tokens "
            "In<>Out API, POST /inference/v1/generate, generates here")

    for path in TEXT_ROUTES:
        app.api_route(path, methods=["GET", "POST"], include_in_schema=False)(refuse)


def _take_header_request_id(request: CompletionRequest | ChatCompletionRequest,
                            raw_request: Request, prefix: str) -> None:
    """A request with no `request_id` of its own is named after its X-Request-Id header
    (cut to 128 characters), as vLLM names it: `{prefix}-{header}` is the response's id
    and the engine's, so the request logs carry the id a proxy gave it. Like a body's
    request_id, one still running makes a second of that id a 400."""
    given = raw_request.headers.get("x-request-id")
    if request.request_id is None and given:
        request.request_id = f"{prefix}-{given[:128]}"


def tokenizer_info_of(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """tokenizer_config.json's fields of `tokenizer` (JSON values only), its class, the
    special tokens, the chat template and the served context length."""
    info: dict[str, Any] = {}
    for key, value in getattr(tokenizer, "init_kwargs", {}).items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        info[key] = value
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        info[name] = str(token) if token is not None else None
    info.update(tokenizer_class=type(tokenizer).__name__, model_max_length=max_model_len,
                vocab_size=len(tokenizer), chat_template=getattr(tokenizer, "chat_template",
                                                                  None))
    return info


def _install_error_handlers(app: FastAPI, log_error_stack: bool = False) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError,
                                  ) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = str(exc.detail)
        if detail == "There was an error parsing the body":  # FastAPI's, for any cause
            detail = ("The request body could not be read as JSON: it must be UTF-8 text, "
                      "uncompressed, with integers of at most 4300 digits")
        return error_response(detail, exc.status_code, headers=exc.headers,
                              path=request.url.path)

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        status = int(error_status(exc))
        if status >= 500 and not isinstance(exc, (EngineDeadError, QueueFullError,
                                                  EngineSleepingError)):
            logger.error("request failed", exc_info=exc)
        elif log_error_stack:
            logger.info("request answered %d", status, exc_info=exc)
        headers = ({"Retry-After": str(RETRY_AFTER_S)} if isinstance(exc, QueueFullError)
                   else None)
        return error_response(exception_message(exc), status, headers=headers,
                              path=request.url.path)

    # Typed errors go through Starlette's ExceptionMiddleware (answered, not re-raised);
    # the catch-all `Exception` handler also answers but Starlette re-raises to log it.
    for exc_type in (ValueError, ModelNotFoundError, ResponseNotFoundError, EngineDeadError,
                     QueueFullError, RequestTimeoutError, EngineSleepingError,
                     EngineBusyError, Exception):
        app.add_exception_handler(exc_type, on_error)


# ------------------------------------------------------------------ running

def served_names(args: argparse.Namespace, model: str | None, model_path: str) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if model:
        return [model]
    # The bundled default: its file name without the quantization suffix.
    return [os.path.basename(model_path).split(".")[0]]


class PathFilter(logging.Filter):
    """Drops uvicorn access lines of some paths (--disable-access-log-for-endpoints):
    its records' args are (client, method, path with query, http version, status)."""

    def __init__(self, paths: frozenset[str]) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths
        return True


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """The server's TCP sockets, bound: one per address of `host`, as asyncio's
    create_server (which uvicorn calls when given no sockets) binds them ("localhost":
    127.0.0.1 and ::1; "": every interface, both families)."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:
                continue  # a family this machine lacks (IPv6 turned off), as asyncio does
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # else "::" would take the IPv4 port too
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
        if not sockets:
            raise OSError(f"no socket of the address family of {host!r} can be opened")
    except OSError as e:  # socket.gaierror too: a host that does not resolve
        for sock in sockets:
            sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sockets


def unix_socket(path: str) -> socket.socket:
    """The server's Unix domain socket at `path` (--uds), bound; a socket file left
    there by a server that died is replaced, any other file is refused."""
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot listen on {path}: {e.strerror or e}") from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {path}: {e.strerror or e}") from None
    return sock


def _server_with_deadline(uv_config: Any, engine: AsyncLLM) -> Any:
    """A uvicorn.Server whose shutdown on SIGTERM/SIGINT has a deadline.

    uvicorn stops gracefully (open streams get --shutdown-timeout); if anything still
    holds the process SHUTDOWN_GRACE_S after that, a watchdog thread (threads run even
    while the event loop is busy) kills the engine process and exits.
    """
    deadline_s = uv_config.timeout_graceful_shutdown + SHUTDOWN_GRACE_S
    import uvicorn

    class Server(uvicorn.Server):
        _watchdog: threading.Thread | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._deadline, daemon=True,
                                                  name="pagedllm-shutdown-watchdog")
                self._watchdog.start()

        @staticmethod
        def _deadline() -> None:
            threading.Event().wait(deadline_s)
            logger.error("shutdown took longer than %.0f s: exiting now", deadline_s)
            with contextlib.suppress(Exception):
                engine.core_client.kill()
            os._exit(1)

    return Server(uv_config)


def import_middleware(path: str) -> Any:
    """The class or function --middleware names (ConfigError when it cannot be)."""
    try:
        found = import_by_name(path)
    except ValueError as e:
        raise ConfigError(f"--middleware {path!r}: {e}") from e
    if not (isinstance(found, type) or inspect.iscoroutinefunction(found)):
        raise ConfigError(f"--middleware {path!r} is neither a class nor an async "
                          f"function (request, call_next)")
    return found


async def serve(args: argparse.Namespace, engine_args: Any,
                serve_config: ServeConfig | None = None) -> None:
    """Start the engine, then serve HTTP until SIGINT/SIGTERM."""
    # The flags read, and bound, before the model loads: a bad flag or a port in use
    # fails in a second, not after the load.
    lora_modules = [parse_lora_module(m) for m in args.lora_modules or ()]
    args.middleware = [import_middleware(m) for m in getattr(args, "middleware", ())]
    uds = getattr(args, "uds", None)
    sockets = [unix_socket(uds)] if uds else listen_sockets(args.host, args.port)
    # The engine process starts now: its imports overlap reading the model's config
    # here (~2.5 s each; the bundled model's server was healthy after 6.8-7.0 s, now
    # 4.8-5.8 s).
    core = EngineProcess()
    try:
        config = engine_args.create_engine_config()
        names = served_names(args, engine_args.model, config.model.path)
        await _serve_on(sockets, args, config, names, serve_config, lora_modules, core)
    finally:
        core.cancel()  # unless the engine took it
        for sock in sockets:
            sock.close()
        if uds:
            with contextlib.suppress(OSError):
                os.unlink(uds)


def make_engine(config: Any, model_name: str, serve_config: ServeConfig,
                core: EngineProcess, log_stats_interval: float) -> AsyncLLM:
    """The server's AsyncLLM (not started) over the engine process `core`."""
    # Constraints are parsed in a child process, each under --render-timeout of CPU time
    # (constraint_check.py: a few bytes of JSON schema can take xgrammar minutes).
    constraints = ConstraintChecker(
        serve_config.render_timeout,
        int(config.structured_outputs.compile_memory_gib * (1 << 30)),
        limit_names=("--render-timeout", "--grammar-compile-memory"))
    return AsyncLLM(config, model_name=model_name, log_stats_interval_s=log_stats_interval,
                    constraints=constraints, core_process=core,
                    skip_tokenizer_init=(serve_config.tokens_only
                                         or serve_config.skip_tokenizer_init))


async def _serve_on(sockets: list[socket.socket], args: argparse.Namespace, config: Any,
                    names: list[str], serve_config: ServeConfig | None,
                    lora_modules: list[tuple[str, str]], core: EngineProcess) -> None:
    import torch
    import uvicorn

    from pagedllm.config import env_api_key

    # The engine process owns the cores; this process only parses and detokenizes.
    torch.set_num_threads(1)
    # Request templates render in worker threads, which hold the GIL until the switch
    # interval: at CPython's 5 ms each of the GIL hand-offs a /health answer or a stream
    # write needs could wait that long (two renders at once: /health up to ~100 ms).
    # At 1 ms: ~30-50 ms, and serving batch64 measured the same either way.
    sys.setswitchinterval(0.001)
    serve_config = serve_config or ServeConfig()
    guard = ConnectionGuard(serve_config.read_timeout, serve_config.write_timeout,
                            serve_config.max_connections
                            or default_max_connections(raise_open_file_limit()),
                            serve_config.h11_max_incomplete_event_size,
                            serve_config.h11_max_header_count)
    engine = make_engine(config, names[0], serve_config, core, args.log_stats_interval)
    try:
        await engine.start()
        # Start-up objects (torch, transformers, the tokenizer) are permanent: keep
        # them out of the collector so a full collection cannot stall /health.
        gc.collect()
        gc.freeze()
        app = build_app(engine, names, api_key=args.api_key or env_api_key(),
                        shutdown_engine=True, serve_config=serve_config,
                        lora_modules=lora_modules, root_path=args.root_path,
                        middleware=args.middleware)
        uv_config = uvicorn.Config(app, host=args.host, port=args.port,
                                   **guard.uvicorn_options(),
                                   timeout_keep_alive=serve_config.keep_alive_timeout,
                                   log_level=args.uvicorn_log_level,
                                   # Its records go through the root handler
                                   # (log_config.py): one format, JSON included.
                                   log_config=None,
                                   timeout_graceful_shutdown=serve_config.shutdown_timeout,
                                   access_log=getattr(args, "uvicorn_access_log", False),
                                   ssl_keyfile=args.ssl_keyfile,
                                   ssl_certfile=args.ssl_certfile,
                                   ssl_ca_certs=args.ssl_ca_certs,
                                   ssl_cert_reqs=args.ssl_cert_reqs,
                                   **({"ssl_ciphers": args.ssl_ciphers}
                                      if getattr(args, "ssl_ciphers", None) else {}))
        guard.quiet_accept_errors(asyncio.get_running_loop())
        server = _server_with_deadline(uv_config, engine)
        if getattr(args, "uvicorn_access_log", False):
            # Its lines are INFO: shown even when uvicorn's other loggers say less.
            access = logging.getLogger("uvicorn.access")
            access.setLevel(logging.INFO)
            excluded = serve_config.access_log_excluded_paths()
            if excluded:
                access.addFilter(PathFilter(excluded))
        scheme = "https" if args.ssl_certfile else "http"
        if getattr(args, "uds", None):
            logger.info("serving %s on %s (unix socket) /v1", names[0], args.uds)
        else:
            logger.info("serving %s on %s://%s:%d/v1", names[0], scheme, args.host,
                        args.port)
        await server.serve(sockets=sockets)
    finally:
        engine.shutdown()
