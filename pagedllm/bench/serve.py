"""`pagedllm bench serve`: an async client against a running OpenAI-compatible server.

Each request is a streamed `/v1/completions` call with the prompt as token ids, greedy,
`max_tokens` and `ignore_eos`; requests arrive as a Poisson process (`--request-rate`,
seeded; inf = all at once), at most `--max-concurrency` in flight. Measured per request:
TTFT (sent -> first token chunk), ITL (gaps between token chunks), TPOT ((e2e - TTFT) /
(output tokens - 1)) and e2e latency; reported as mean / median / p90 / p99 in ms, with
throughput and failures.

`--soak` runs a mixed, validated workload instead and watches the server's memory and KV
cache (pagedllm/bench/soak.py). `--api-key` (default: env PAGEDLLM_API_KEY) is sent as
'Authorization: Bearer KEY' on every request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.bench.common import (BenchRequest, add_workload_args, emit, summarize,
                                   workload_from_args)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root; requests go to BASE_URL/v1/completions")
    parser.add_argument("--model", default=None,
                        help="model name sent in requests (default: the first of /v1/models)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight at once (default: unlimited)")
    parser.add_argument("--random-vocab-size", type=int, default=32000,
                        help="token ids of random prompts are drawn below this")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    parser.add_argument("--api-key", default=None,
                        help="sent as 'Authorization: Bearer KEY' (default: env "
                             "PAGEDLLM_API_KEY)")
    soak = parser.add_argument_group("soak")
    soak.add_argument("--soak", action="store_true",
                      help="a seeded mix of completions / chat, streamed or not, n, stop, "
                           "logprobs and client disconnects, each response validated; "
                           "reports failures, latency, server RSS growth, leaked KV blocks "
                           "(default --num-prompts 1000)")
    soak.add_argument("--soak-max-tokens", type=int, default=32,
                      help="cap on each soak request's max_tokens")
    soak.add_argument("--stats-interval", type=float, default=5.0,
                      help="seconds between reads of BASE_URL/debug/stats during a soak")
    add_workload_args(parser, seed=True)


@dataclass
class RequestResult:
    """What one streamed request measured."""

    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    # Gaps between consecutive token chunks.
    itl_s: list[float] = field(default_factory=list)


def _is_token_chunk(chunk: dict[str, Any]) -> bool:
    """A chunk that carries a token: text (possibly "" for a partial character) and no
    finish marker, or text together with its finish marker."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    return bool(choice.get("text")) or choice.get("finish_reason") is None


async def send_request(session: Any, url: str, model: str | None, request: BenchRequest,
                       ) -> RequestResult:
    body: dict[str, Any] = {
        "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
        "temperature": 0.0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    result = RequestResult(prompt_tokens=len(request.prompt_token_ids))
    start = last = time.perf_counter()
    chunks, usage_tokens = 0, None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:300]}"
                return result
            async for line in response.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if not _is_token_chunk(chunk):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last, chunks = now, chunks + 1
    except Exception as e:  # network errors, bad JSON: a failed request, not a crash
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


def auth_headers(ns: argparse.Namespace) -> dict[str, str]:
    from pagedllm.config import env_api_key

    api_key = ns.api_key or env_api_key()
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def run_requests(ns: argparse.Namespace, requests: list[BenchRequest],
                       ) -> tuple[list[RequestResult], float, str | None]:
    """Send every request on schedule; (results, duration_s, model name).

    aiohttp, not httpx (the soak's client): the client shares the machine with the
    server it measures, and httpx's streaming took about twice the CPU (a batch64 run
    served on 2 cores: ~1.7 against ~0.9 CPU-seconds; the measured rate 7-12% lower)."""
    import aiohttp

    base_url = ns.base_url.rstrip("/")
    url = f"{base_url}/v1/completions"
    limit = ns.max_concurrency or len(requests)
    rng = random.Random(ns.seed)
    semaphore = asyncio.Semaphore(limit)
    # A chunk is one line: allow lines far longer than any this workload streams.
    async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit), headers=auth_headers(ns),
            timeout=aiohttp.ClientTimeout(total=ns.timeout), read_bufsize=1 << 20) as session:
        model = ns.model or await _model_name(session, base_url)

        async def limited(request: BenchRequest) -> RequestResult:
            async with semaphore:
                return await send_request(session, url, model, request)

        start = time.perf_counter()
        tasks = []
        for i, request in enumerate(requests):
            if i and ns.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(ns.request_rate))
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start, model


async def _model_name(session: Any, base_url: str) -> str | None:
    """The first model the server lists; None when it does not answer."""
    try:
        async with session.get(f"{base_url}/v1/models") as response:
            return (await response.json())["data"][0]["id"]
    except Exception:
        return None


def aggregate(results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_prompt_tokens": prompt, "total_output_tokens": output,
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        **summarize([r.ttft_s for r in done], "ttft_ms", 1e3),
        **summarize(tpot, "tpot_ms", 1e3),
        **summarize([g for r in done for g in r.itl_s], "itl_ms", 1e3),
        **summarize([r.e2e_s for r in done], "e2el_ms", 1e3),
    }


def run(ns: argparse.Namespace) -> dict[str, Any]:
    import logging

    # httpx logs every request at INFO: thousands of lines over the summary.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if ns.soak:
        from pagedllm.bench import soak

        return soak.run(ns, auth_headers(ns))
    requests = workload_from_args(ns, ns.random_vocab_size)
    results, duration, model = asyncio.run(run_requests(ns, requests))
    result = {"base_url": ns.base_url, "model": model, "num_requests": len(requests),
              "request_rate": ns.request_rate, "max_concurrency": ns.max_concurrency,
              **aggregate(results, duration)}
    emit(result, "serve", _summary(result))
    return result


def _summary(r: dict[str, Any]) -> list[str]:
    lines = [f"requests:           {r['completed']} completed, {r['failed']} failed "
             f"in {r['duration_s']:.2f} s",
             f"request throughput: {r['request_throughput']:.2f} req/s",
             f"output throughput:  {r['output_throughput']:.1f} tok/s "
             f"(total {r['total_token_throughput']:.1f} tok/s)"]
    for name, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                        ("e2el_ms", "E2E latency")):
        lines.append(f"{label + ' (ms):':<20}mean {r[f'{name}_mean']:.1f}  median {r[name]:.1f}"
                     f"  p90 {r[f'{name}_p90']:.1f}  p99 {r[f'{name}_p99']:.1f}")
    for error in r["errors"]:
        lines.append(f"error: {error}")
    return lines
