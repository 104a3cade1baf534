"""`pagedllm run-batch -i IN.jsonl -o OUT.jsonl`: a file of requests in OpenAI's batch
format (vLLM's `run-batch`), run by the server's own routes in-process.

Each input line is {"custom_id": str, "method": "POST", "url": a route, "body": the
request}; each output line, in input order, {"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}, the body being exactly what the
server answers (an error body with its status for a bad request, as OpenAI's batch
output). A line that is not such a request (invalid JSON, a repeated custom_id, an
unknown url, a stream) gets "response": null and an "error" {"code", "message"}; the
other lines run all the same.

The requests go through the FastAPI app over httpx's ASGI transport: the same
validation, limits and answers as `pagedllm serve`, with no socket. At most
--max-concurrency lines are in flight (the engine batches them); results are written
as the oldest in flight finishes, so memory stays bounded whatever the file's length.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import uuid
from collections import deque
from collections.abc import Awaitable
from typing import IO, Any

import httpx

from pagedllm.engine.core_client import EngineProcess
from pagedllm.entrypoints.openai.middleware import LOAD_PATHS
from pagedllm.entrypoints.openai.serve_config import ServeConfig
from pagedllm.entrypoints.openai.served_models import parse_lora_module
from pagedllm.entrypoints.openai.server import build_app, make_engine, served_names
from pagedllm.errors import ConfigError

logger = logging.getLogger(__name__)

# The routes a line may name: those that generate or pool (the server's load-tracked
# routes), plus token counting.
BATCH_URLS = frozenset(LOAD_PATHS | {"/tokenize", "/detokenize",
                                     "/v1/messages/count_tokens"})


class LineError(ValueError):
    """An input line that is not a batch request (its output line says why)."""

    def __init__(self, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.custom_id = custom_id


def parse_line(text: str, seen: set[str]) -> tuple[str, str, dict[str, Any]]:
    """(custom_id, url, body) of one input line; LineError for what is wrong. `seen`:
    the custom_ids so far (a repeat is an error, as OpenAI's)."""
    try:
        line = json.loads(text)
    except ValueError as e:
        raise LineError(f"the line is not valid JSON: {e}") from None
    if not isinstance(line, dict):
        raise LineError("the line must be a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("custom_id must be a non-empty string")
    unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise LineError(f"unknown field {unknown[0]!r} (a line has custom_id, method, url "
                        f"and body)", custom_id)
    if custom_id in seen:
        raise LineError(f"custom_id {custom_id!r} is used by an earlier line", custom_id)
    seen.add(custom_id)
    if line.get("method") != "POST":
        raise LineError(f"method must be \"POST\", got {line.get('method')!r}", custom_id)
    url = line.get("url")
    if url not in BATCH_URLS:
        raise LineError(f"url {str(url)[:100]!r} is not a batch route (one of "
                        f"{', '.join(sorted(BATCH_URLS))})", custom_id)
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineError("body must be a JSON object", custom_id)
    if body.get("stream"):
        raise LineError("a batch request cannot stream (stream: true)", custom_id)
    return custom_id, url, body


def error_line(e: LineError) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": e.custom_id,
            "response": None, "error": {"code": "invalid_request", "message": str(e)}}


async def run_line(client: httpx.AsyncClient, custom_id: str, url: str,
                   body: dict[str, Any]) -> dict[str, Any]:
    """One request through the app: its output line."""
    response = await client.post(url, json=body)
    try:
        payload = response.json()
    except ValueError:
        payload = response.text
    given = payload.get("id") if isinstance(payload, dict) else None
    request_id = given if isinstance(given, str) else f"batch-{uuid.uuid4().hex}"
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": response.status_code, "request_id": request_id,
                         "body": payload},
            "error": None}


async def run_lines(client: httpx.AsyncClient, infile: IO[str], outfile: IO[str],
                    max_concurrency: int) -> tuple[int, int]:
    """Every line of `infile` run, its output line written to `outfile` in input order;
    (lines run, lines whose answer is not a 200)."""
    seen: set[str] = set()
    in_flight: deque[Awaitable[dict[str, Any]]] = deque()
    num_lines = num_failed = 0

    async def write_oldest() -> None:
        nonlocal num_failed
        line = await in_flight.popleft()
        response = line["response"]
        num_failed += response is None or response["status_code"] != 200
        outfile.write(json.dumps(line, ensure_ascii=False) + "\n")

    async def done(result: dict[str, Any]) -> dict[str, Any]:
        return result

    while True:
        # A read may block (stdin): off the event loop, which runs the lines in flight.
        text = await asyncio.to_thread(infile.readline)
        if not text:
            break
        if not text.strip():
            continue
        num_lines += 1
        try:
            custom_id, url, body = parse_line(text, seen)
        except LineError as e:
            in_flight.append(done(error_line(e)))
        else:
            in_flight.append(asyncio.ensure_future(run_line(client, custom_id, url, body)))
        while len(in_flight) >= max_concurrency:
            await write_oldest()
    while in_flight:
        await write_oldest()
    outfile.flush()
    return num_lines, num_failed


async def run_batch(ns: argparse.Namespace, engine_args: Any,
                    serve_config: ServeConfig) -> int:
    """The command: the files opened and the flags checked before the model loads."""
    if ns.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be at least 1, got {ns.max_concurrency}")
    lora_modules = [parse_lora_module(m) for m in ns.lora_modules or ()]
    # One line per request would be logged at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with contextlib.ExitStack() as files:
        infile = sys.stdin if ns.input_file == "-" else _open(files, ns.input_file, "r")
        outfile = sys.stdout if ns.output_file == "-" else _open(files, ns.output_file, "w")
        core = EngineProcess()
        try:
            config = engine_args.create_engine_config()
            names = served_names(ns, engine_args.model, config.model.path)
            engine = make_engine(config, names[0], serve_config, core, ns.log_stats_interval)
        except BaseException:
            core.cancel()
            raise
        try:
            await engine.start()
            app = build_app(engine, names, serve_config=serve_config,
                            lora_modules=lora_modules)
            transport = httpx.ASGITransport(app=app)
            async with (app.router.lifespan_context(app),
                        httpx.AsyncClient(transport=transport, base_url="http://batch",
                                          timeout=None) as client):
                num_lines, num_failed = await run_lines(client, infile, outfile,
                                                        ns.max_concurrency)
        finally:
            engine.shutdown()
    logger.info("run-batch: %d requests, %d answered 200, %d not", num_lines,
                num_lines - num_failed, num_failed)
    return 0


def _open(files: contextlib.ExitStack, path: str, mode: str) -> IO[str]:
    try:
        return files.enter_context(open(path, mode, encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot open {path}: {e.strerror or e}") from None
