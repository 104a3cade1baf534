"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncLLM.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize,
POST /detokenize, GET /health, GET /version, GET /metrics, GET /debug/stats.
Errors use OpenAI's body ({"error": {message, type, param, code}}, plus vLLM's
"object": "error"): 400 for invalid parameters (FastAPI's 422 included), 401 for a
missing or wrong API key (only /v1 routes, as vLLM), 404 for an unknown model, 503 once
the engine process is gone. /health never waits on the engine: it checks the process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hmac
import logging
import os
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, DetokenizeResponse,
                                                  ModelCard, ModelList, TokenizeRequest,
                                                  TokenizeResponse)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_common import (ModelNotFoundError, error_body,
                                                        error_status, exception_message)
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's errors, and the offending field."""
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error")
            return "Invalid JSON in the request body" + (f": {reason}" if reason else ""), None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc and param is None:
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", param


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
              api_key: str | None = None, shutdown_engine: bool = False) -> FastAPI:
    """The FastAPI app; with `shutdown_engine` the app's shutdown stops the engine."""
    from pagedllm import __version__

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if shutdown_engine:
            # Here, not after uvicorn returns: on SIGTERM uvicorn re-raises the signal
            # once it has shut down, which would end the process first.
            engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=__version__,
                  lifespan=lifespan)
    _install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    _add_engine_routes(app, engine, __version__)
    _add_openai_routes(app, engine, served_model_names)
    return app


def _add_engine_routes(app: FastAPI, engine: AsyncLLM, version_str: str) -> None:
    """Health, version, metrics and debug state: no API key, never wait on a batch."""

    @app.get("/health")
    async def health() -> Response:
        try:
            engine.check_health()
        except EngineDeadError as e:
            return error_response(exception_message(e), 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": version_str}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/stats")
    async def debug_stats() -> dict[str, Any]:
        """The core's scheduler and KV-cache state (tests check that aborts free blocks)."""
        import psutil

        stats = await engine.call_utility("get_stats")
        return stats | {"num_front_end_requests": len(engine.core_client.requests),
                        "api_rss_bytes": psutil.Process().memory_info().rss}


def _add_openai_routes(app: FastAPI, engine: AsyncLLM, served_model_names: list[str]) -> None:
    completions = OpenAIServingCompletion(engine, served_model_names)
    chat = OpenAIServingChat(engine, served_model_names)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=engine.config.model.path,
                                         max_model_len=engine.max_model_len)
                               for name in served_model_names])

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        if request.stream:
            return await completions.create_completion(request)
        return await _cancel_on_disconnect(raw_request, completions.create_completion(request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Any:
        if request.stream:
            return await chat.create_chat_completion(request)
        return await _cancel_on_disconnect(raw_request, chat.create_chat_completion(request))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages")
        if request.messages is not None:
            _, ids = chat.render_chat(request.messages, request.add_generation_prompt)
        else:
            ids = engine.tokenizer.encode(request.prompt,
                                          add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len,
                                tokens=ids)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(request.model)
        vocab_size = engine.config.model.hf_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids out of vocabulary (size {vocab_size}): "
                                      f"{bad[:5]}")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(request.tokens))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        status = int(error_status(exc))
        if status >= 500 and not isinstance(exc, EngineDeadError):
            logger.error("request failed", exc_info=exc)
        return error_response(exception_message(exc), status)

    # Typed errors go through Starlette's ExceptionMiddleware (answered, not re-raised);
    # the catch-all `Exception` handler also answers but Starlette re-raises to log it.
    for exc_type in (ValueError, ModelNotFoundError, EngineDeadError, Exception):
        app.add_exception_handler(exc_type, on_error)


class APIKeyMiddleware:
    """Pure ASGI check of 'Authorization: Bearer KEY' on /v1 routes (a pure middleware
    leaves `receive` alone, so streams still see client disconnects)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and scope["path"].startswith("/v1")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response("Unauthorized: a valid API key is required "
                                          "(Authorization: Bearer KEY).", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ------------------------------------------------------------------ running

def served_names(args: argparse.Namespace, model: str | None, model_path: str) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if model:
        return [model]
    # The bundled default: its file name without the quantization suffix.
    return [os.path.basename(model_path).split(".")[0]]


async def serve(args: argparse.Namespace, engine_args: Any) -> None:
    """Start the engine, then serve HTTP until SIGINT/SIGTERM."""
    import torch
    import uvicorn

    # The engine process owns the cores; this process only parses and detokenizes.
    torch.set_num_threads(1)
    config = engine_args.create_engine_config()
    names = served_names(args, engine_args.model, config.model.path)
    engine = AsyncLLM(config, model_name=names[0],
                      log_stats_interval_s=args.log_stats_interval)
    try:
        await engine.start()
        # Start-up objects (torch, transformers, the tokenizer) are permanent: keep
        # them out of the collector so a full collection cannot stall /health.
        gc.collect()
        gc.freeze()
        app = build_app(engine, names, api_key=args.api_key, shutdown_engine=True)
        uv_config = uvicorn.Config(app, host=args.host, port=args.port,
                                   log_level=args.uvicorn_log_level,
                                   timeout_graceful_shutdown=3, access_log=False)
        server = uvicorn.Server(uv_config)
        logger.info("serving %s on http://%s:%d/v1", names[0], args.host, args.port)
        await server.serve()
    finally:
        engine.shutdown()
