"""The server's pure ASGI middlewares and its error answer.

Pure ASGI (not Starlette's BaseHTTPMiddleware): they leave `receive` to the app, so a
streaming response still sees its client leave. `APIKeyMiddleware` checks the bearer
key, `BodyLimitMiddleware` bounds a body's size and the time it may take to arrive,
`RequestIdMiddleware` puts X-Request-Id on every answer, `LoadMiddleware` counts the
requests in flight.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.entrypoints.anthropic import protocol as anthropic
from pagedllm.entrypoints.openai.serving_common import error_body

# The routes of Anthropic's Messages API, whose errors take Anthropic's form.
ANTHROPIC_PATH = "/v1/messages"


def error_response(message: str, status: int, param: str | None = None,
                   headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """The error answer: OpenAI's body, or Anthropic's on its routes (`path`)."""
    body = (anthropic.error_body(message, status) if ANTHROPIC_PATH in path
            else error_body(message, status, param))
    return JSONResponse(body, status_code=status, headers=headers)


class APIKeyMiddleware:
    """Pure ASGI check of 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY')
    on every route but `open_paths` (a pure middleware leaves `receive` alone, so
    streams still see client disconnects)."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: set[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and scope["path"] not in self.open_paths):
            headers = dict(scope["headers"])
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            key = hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected_key)
            if not (bearer or key):
                response = error_response("Unauthorized: a valid API key is required "
                                          "(Authorization: Bearer KEY, or x-api-key: KEY).",
                                          401, path=scope["path"])
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """`--enable-request-id-headers` (vLLM's): every response carries X-Request-Id, the
    request's own header (cut to 128 bytes) or a new random id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"")[:128]
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ServerLoad:
    """The requests the load middleware counts as in flight (GET /load reads it)."""

    def __init__(self) -> None:
        self.value = 0


# Routes that run requests on the engine (vLLM's load-aware ones).
LOAD_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/pooling",
    "/v1/responses", "/score", "/v1/score", "/classify", "/v1/classify", "/rerank",
    "/v1/rerank", "/v2/rerank", "/invocations", "/inference/v1/generate",
    "/v1/messages", "/v1/chat/completions/batch"})


class LoadMiddleware:
    """`--enable-server-load-tracking` (vLLM's): counts the POSTs to LOAD_PATHS from
    arrival until their answer (a stream's last event included) is sent, for GET /load
    (a load balancer's signal)."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] in LOAD_PATHS):
            await self.app(scope, receive, send)
            return
        self.load.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.value -= 1


# Sent with an answer given before the request's body was read.
CLOSE = {"Connection": "close"}


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`: by its Content-Length up front, or, for a
    chunked body, as soon as the bytes received pass the limit (never buffered whole).
    408 for a body not received within `read_timeout` seconds of its headers (a client
    trickling its body held the connection for ever; connections.py has the rest of
    the slow-client rules). Either way the connection is closed after the answer: the
    rest of the body would have to be read first."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    def _too_large(self) -> _BodyRejected:
        return _BodyRejected(413, f"The request body is larger than {self.max_bytes} bytes "
                                  f"(--max-body-bytes).", headers=CLOSE)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _rejection_response(self._too_large(), scope)(scope, receive, send)
            return
        received = 0
        body_done = False
        started = False
        deadline = asyncio.get_running_loop().time() + self.read_timeout

        async def send_wrapper(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def limited_receive() -> dict:
            nonlocal received, body_done
            if body_done:  # a response listening for the client leaving: no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _BodyRejected(408, f"The request body did not arrive within "
                                         f"{self.read_timeout:g} s of its headers "
                                         f"(--read-timeout).", headers=CLOSE) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        try:
            await self.app(scope, limited_receive, send_wrapper)
        except _BodyRejected as e:
            if not started:
                await _rejection_response(e, scope)(scope, receive, send)


class _BodyRejected(StarletteHTTPException):
    """Raised while the body is read: FastAPI passes HTTP exceptions through to the
    error handlers (anything else would become its generic 400)."""


def _rejection_response(e: _BodyRejected, scope: Scope) -> JSONResponse:
    return error_response(str(e.detail), e.status_code, headers=e.headers, path=scope["path"])
