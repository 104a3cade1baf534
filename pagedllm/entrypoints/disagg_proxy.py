"""`pagedllm disagg-proxy`: disaggregated prefill in front of two kinds of servers.

Each completion or chat request goes first to a prefill server (kv_producer) as the
same request with one token to generate: it computes the prompt's K/V and saves its
full blocks to the shared directory (kv_transfer_config). Then the request itself goes
to a decode server (kv_consumer), which loads those blocks instead of computing them
and streams the answer back through the proxy unchanged. Servers of each kind are taken
in turn.

What a client sees is the decode server's answer, byte for byte: its errors included
(a request the prefill server refuses with a 4xx is answered with that refusal). When a
prefill server is down or fails, the request still goes to a decode server, which then
computes the prompt itself: slower, never lost. A decode server that cannot be reached
is a 502.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.middleware import BodyLimitMiddleware

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Headers passed on to the servers (the body's length and encoding are httpx's).
FORWARDED_HEADERS = ("authorization", "content-type", "x-request-id")
PREFILL_TIMEOUT_S = 600.0
# The servers' defaults (serve_config.py): the proxy holds a whole body before sending it.
MAX_BODY_BYTES = 2 << 20
READ_TIMEOUT_S = 30.0


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill server gets it: one token, not streamed, one sample,
    nothing that only changes the answer's form."""
    body = dict(body)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body["n"] = 1
    for key in ("stream_options", "best_of", "use_beam_search"):
        body.pop(key, None)
    return body


def prefill_content(raw: bytes) -> bytes | None:
    """The prefill server's request body, or None when `raw` is no JSON object the
    proxy can rewrite (the decode server then answers it, a 400 naming the problem):
    invalid or too deeply nested JSON, NaN or infinite numbers, lone surrogates."""
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            return None
        return json.dumps(prefill_body(body), allow_nan=False).encode()
    except (ValueError, RecursionError):  # (UnicodeError is a ValueError)
        return None


def build_app(prefill_urls: Sequence[str], decode_urls: Sequence[str],
              timeout_s: float = PREFILL_TIMEOUT_S,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The proxy's app over servers at `prefill_urls` and `decode_urls`; a request body
    over `max_body_bytes` is refused (413) before it is read whole."""
    if not prefill_urls or not decode_urls:
        raise ValueError("disagg-proxy needs at least one --prefill and one --decode URL")
    prefill_urls = [u.rstrip("/") for u in prefill_urls]
    decode_urls = [u.rstrip("/") for u in decode_urls]
    prefill, decode = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="pagedllm disaggregated prefill proxy", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes,
                       read_timeout=READ_TIMEOUT_S)

    def headers_of(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}

    async def generate(request: Request) -> Response:
        raw = await request.body()
        headers = headers_of(request)
        content = prefill_content(raw)
        if content is not None:
            url = next(prefill) + request.url.path
            try:
                r = await client.post(url, content=content, headers=headers)
                if 400 <= r.status_code < 500:
                    return Response(r.content, status_code=r.status_code,
                                    media_type=r.headers.get("content-type"))
                if r.status_code != 200:
                    logger.warning("prefill %s answered %d: decoding without it", url,
                                   r.status_code)
            except httpx.HTTPError as e:
                logger.warning("prefill %s failed (%s): decoding without it", url, e)
        return await forward(next(decode) + request.url.path, raw, headers)

    async def forward(url: str, raw: bytes, headers: dict[str, str]) -> Response:
        try:
            upstream = await client.send(client.build_request("POST", url, content=raw,
                                                              headers=headers), stream=True)
        except httpx.HTTPError as e:
            logger.warning("decode %s failed: %s", url, e)
            return JSONResponse({"error": {
                "message": f"the decode server {url} could not be reached: {e}",
                "type": "BadGateway", "code": 502}}, status_code=502)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(body(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))

    for path in GENERATION_PATHS:
        app.add_api_route(path, generate, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        r = await client.get(decode_urls[0] + "/v1/models", headers=headers_of(request))
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        try:
            checks = [await client.get(u + "/health", timeout=5.0)
                      for u in dict.fromkeys(prefill_urls + decode_urls)]
        except httpx.HTTPError as e:
            return JSONResponse({"error": f"a server is unreachable: {e}"}, status_code=503)
        ok = all(r.status_code == 200 for r in checks)
        return Response(status_code=200 if ok else 503)

    return app


def run(prefill_urls: Sequence[str], decode_urls: Sequence[str], host: str,
        port: int, max_body_bytes: int = MAX_BODY_BYTES) -> None:
    import uvicorn

    uvicorn.run(build_app(prefill_urls, decode_urls, max_body_bytes=max_body_bytes),
                host=host, port=port, log_level="info")
