"""`pagedllm bench serve --soak`: many mixed requests against a running server, checking
every response and watching the server's memory and KV cache.

Each of `--num-prompts` requests (default 1000) gets a kind in the shares below (exactly,
by largest remainder; each kind at least once), shuffled with `--seed`, which also draws
chat texts (4-12 words of a fixed list), n, seeds and hang-up points: runs repeat.
Completions prompts are the workload's token ids; max_tokens the workload's, capped at
`--soak-max-tokens`. All are greedy except the n kinds.

    kind                  share  endpoint, mode        extra fields
    cmpl                   14%   completions           -
    cmpl_stream            14%   completions, stream   -
    chat                   10%   chat                  -
    chat_stream            10%   chat, stream          -
    cmpl_n                  8%   completions           n 2|3, temperature 0.8, seed
    chat_n_stream           6%   chat, stream          n 2|3, temperature 0.8, seed
    chat_stop               8%   chat                  stop ["\\n", "."]
    cmpl_stop_stream        6%   completions, stream   stop ["\\n", "."]
    cmpl_logprobs           8%   completions           logprobs 2
    chat_logprobs_stream    6%   chat, stream          logprobs true, top_logprobs 2
    disconnect             10%   either, stream        ignore_eos; hang up after 2-4 chunks

Checks (a miss is a failure with a short error): HTTP 200; choice indexes 0..n-1, each
with a finish_reason of "stop" or "length" and no stop string in its text; usage present
with total = prompt + completion, prompt = the prompt's length for token-id prompts, and
length-finished choices * max_tokens <= completion <= n * max_tokens; logprobs on every
token (as many entries as completion tokens; `length` choices have max_tokens) with 1..2
alternatives (completions: +1 for the chosen token); streams end with [DONE] and carry no
error event. A `disconnect` request that hangs up counts as disconnected, not failed.

GET BASE_URL/debug/stats is read before, every `--stats-interval` s during (on its own
connection, never queued behind requests) and after the run once the server is idle: RSS
of the API and engine processes (start / peak / end / growth, MB) and leaked KV blocks
(all but the null block must be free then). Without stats both are null.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.bench.common import (BenchRequest, emit, fetch_model_name, summarize,
                                   workload_from_args)

STOP = ["\n", "."]
NUM_TOP = 2
IDLE_TIMEOUT_S = 10.0  # after the run, how long to wait for the server to go idle
WORDS = ("apple river stone cloud music garden window silver morning paper bridge "
         "forest candle ocean letter mountain engine story winter yellow quiet market "
         "travel number summer doctor planet coffee island pencil").split()


@dataclass(frozen=True)
class Kind:
    """A request kind of the mix (the table above)."""

    name: str
    share: int  # percent of the requests
    is_chat: bool
    is_stream: bool
    feature: str = ""  # "", "n", "stop", "logprobs" or "disconnect"


KINDS = (
    Kind("cmpl", 14, False, False), Kind("cmpl_stream", 14, False, True),
    Kind("chat", 10, True, False), Kind("chat_stream", 10, True, True),
    Kind("cmpl_n", 8, False, False, "n"), Kind("chat_n_stream", 6, True, True, "n"),
    Kind("chat_stop", 8, True, False, "stop"), Kind("cmpl_stop_stream", 6, False, True, "stop"),
    Kind("cmpl_logprobs", 8, False, False, "logprobs"),
    Kind("chat_logprobs_stream", 6, True, True, "logprobs"),
    Kind("disconnect", 10, False, True, "disconnect"),
)


@dataclass
class SoakRequest:
    """One planned request and what its response must satisfy."""

    kind: str
    path: str
    body: dict[str, Any]
    is_chat: bool
    n: int
    max_tokens: int
    stop: list[str] | None = None
    num_top: int | None = None  # logprobs alternatives asked for; None: no logprobs
    num_prompt_tokens: int | None = None  # known for token-id prompts only
    disconnect_after: int | None = None  # data chunks read before hanging up


@dataclass
class SoakResult:
    """How one request ended; latencies and tokens count for completed ones only."""

    kind: str
    status: str = "failed"  # "completed", "failed" or "disconnected"
    error: str = ""
    ttft_s: float | None = None  # streams only
    e2e_s: float = 0.0
    output_tokens: int = 0


@dataclass
class _Choices:
    """A response's choices: from a full body, or accumulated over a stream's chunks."""

    text: dict[int, str] = field(default_factory=dict)
    finish_reason: dict[int, str] = field(default_factory=dict)
    num_logprobs: dict[int, int] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    error: str = ""  # the first malformed logprobs entry


# ------------------------------------------------------------------ planning

def allot_kinds(num: int, rng: random.Random) -> list[Kind]:
    """`num` kinds in the shares of KINDS (largest remainder), shuffled."""
    total = sum(k.share for k in KINDS)
    exact = [num * k.share / total for k in KINDS]
    counts = [int(x) for x in exact]
    if num >= len(KINDS):  # every kind at least once
        counts = [max(c, 1) for c in counts]
    by_remainder = sorted(range(len(KINDS)), key=lambda i: int(exact[i]) - exact[i])
    for i in range(num - sum(counts)):
        counts[by_remainder[i % len(KINDS)]] += 1
    while sum(counts) > num:  # the floor of one overshot: trim the largest
        counts[counts.index(max(counts))] -= 1
    kinds = [k for k, c in zip(KINDS, counts) for _ in range(c)]
    rng.shuffle(kinds)
    return kinds


def plan_requests(workload: list[BenchRequest], max_tokens_cap: int, model: str | None,
                  seed: int) -> list[SoakRequest]:
    rng = random.Random(seed)
    kinds = allot_kinds(len(workload), rng)
    return [_plan_one(kind, req, min(req.max_tokens, max_tokens_cap), model, rng)
            for kind, req in zip(kinds, workload)]


def _plan_one(kind: Kind, req: BenchRequest, max_tokens: int, model: str | None,
              rng: random.Random) -> SoakRequest:
    is_chat = rng.random() < 0.5 if kind.feature == "disconnect" else kind.is_chat
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0,
                            "stream": kind.is_stream}
    if model:
        body["model"] = model
    if kind.is_stream:
        body["stream_options"] = {"include_usage": True}
    plan = SoakRequest(kind.name, "/v1/chat/completions" if is_chat else "/v1/completions",
                       body, is_chat, 1, max_tokens)
    if is_chat:
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
        body["messages"] = [{"role": "user", "content": " ".join(words)}]
    else:
        body["prompt"] = req.prompt_token_ids
        plan.num_prompt_tokens = len(req.prompt_token_ids)
    if kind.feature == "n":
        plan.n = rng.choice((2, 3))
        body.update(n=plan.n, temperature=0.8, seed=rng.randrange(2 ** 31))
    elif kind.feature == "stop":
        plan.stop = body["stop"] = STOP
    elif kind.feature == "logprobs":
        plan.num_top = NUM_TOP
        body.update({"logprobs": True, "top_logprobs": NUM_TOP} if is_chat
                    else {"logprobs": NUM_TOP})
    elif kind.feature == "disconnect":
        # ignore_eos: the stream must still be running when the client hangs up.
        body["ignore_eos"] = True
        plan.disconnect_after = rng.randint(2, 4)
    return plan


# ------------------------------------------------------------------ responses

def _add_choice(acc: _Choices, choice: dict[str, Any], plan: SoakRequest) -> None:
    """Fold one choice (of a full body or of a stream chunk) into `acc`."""
    index = int(choice["index"])
    if plan.is_chat:
        content = (choice.get("message") or choice.get("delta") or {}).get("content")
    else:
        content = choice.get("text")
    acc.text[index] = acc.text.get(index, "") + (content or "")
    if choice.get("finish_reason") is not None:
        acc.finish_reason[index] = choice["finish_reason"]
    logprobs = choice.get("logprobs")
    if logprobs:
        acc.num_logprobs[index] = acc.num_logprobs.get(index, 0) + _count_logprobs(
            acc, logprobs, plan)


def _count_logprobs(acc: _Choices, logprobs: dict[str, Any], plan: SoakRequest) -> int:
    """Tokens carrying logprobs; a malformed entry is noted in acc.error."""
    num_top = plan.num_top or 0
    if plan.is_chat:
        entries = logprobs.get("content") or []
        tops = [len(e.get("top_logprobs") or []) for e in entries]
        chosen = [e.get("logprob") for e in entries]
        max_top = num_top
    else:
        entries = logprobs.get("tokens") or []
        chosen = logprobs.get("token_logprobs") or []
        tops = [len(t or {}) for t in logprobs.get("top_logprobs") or []]
        max_top = num_top + 1  # completions' top_logprobs dicts also hold the chosen token
        if not len(entries) == len(chosen) == len(tops):
            acc.error = acc.error or (f"logprobs lists differ: {len(entries)} tokens, "
                                      f"{len(chosen)} logprobs, {len(tops)} tops")
    if any(not isinstance(lp, (int, float)) for lp in chosen):
        acc.error = acc.error or "a token without a logprob"
    if any(not 1 <= t <= max_top for t in tops):
        acc.error = acc.error or f"top logprobs sizes {sorted(set(tops))}, asked {num_top}"
    return len(entries)


def validate(plan: SoakRequest, acc: _Choices) -> str:
    """"" if the response satisfies the request, else what is wrong."""
    if sorted(acc.text) != list(range(plan.n)):
        return f"choice indexes {sorted(acc.text)}, expected {plan.n}"
    for i in range(plan.n):
        if acc.finish_reason.get(i) not in ("stop", "length"):
            return f"choice {i}: finish_reason {acc.finish_reason.get(i)!r}"
        if plan.stop and any(s in acc.text[i] for s in plan.stop):
            return f"choice {i}: a stop string in {acc.text[i][-40:]!r}"
    usage = acc.usage or {}
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return f"usage missing or malformed: {acc.usage}"
    if usage.get("total_tokens") != prompt + completion:
        return f"usage total {usage.get('total_tokens')} != {prompt} + {completion}"
    if plan.num_prompt_tokens is not None and prompt != plan.num_prompt_tokens:
        return f"usage prompt_tokens {prompt}, sent {plan.num_prompt_tokens}"
    num_length = sum(1 for r in acc.finish_reason.values() if r == "length")
    if not num_length * plan.max_tokens <= completion <= plan.n * plan.max_tokens:
        return (f"completion_tokens {completion} for {num_length} length-finished of "
                f"{plan.n} choices, max_tokens {plan.max_tokens}")
    if plan.num_top is None or acc.error:  # acc.error: a malformed logprobs entry
        return acc.error
    if sum(acc.num_logprobs.values()) != completion:
        return f"{sum(acc.num_logprobs.values())} logprobs for {completion} tokens"
    for i in range(plan.n):
        if acc.finish_reason[i] == "length" and acc.num_logprobs.get(i) != plan.max_tokens:
            return f"choice {i}: {acc.num_logprobs.get(i)} logprobs, max_tokens {plan.max_tokens}"
    return ""


def _has_token(choice: dict[str, Any]) -> bool:
    """A chunk choice that carries output (not the chat role-only opener)."""
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or choice.get("logprobs")
                or choice.get("finish_reason"))


# ------------------------------------------------------------------ sending

async def send(client: Any, plan: SoakRequest) -> SoakResult:
    result = SoakResult(plan.kind)
    start = time.perf_counter()
    try:
        if plan.body["stream"]:
            await _send_stream(client, plan, result, start)
        else:
            await _send_full(client, plan, result)
    except Exception as e:  # network errors, bad JSON: a failed request, not a crash
        result.error = f"{type(e).__name__}: {e}"
    result.e2e_s = time.perf_counter() - start
    if result.error:  # status stays "failed"
        result.error = f"{plan.kind}: {result.error}"[:240]
    return result


async def _send_full(client: Any, plan: SoakRequest, result: SoakResult) -> None:
    response = await client.post(plan.path, json=plan.body)
    if response.status_code != 200:
        result.error = f"HTTP {response.status_code}: {response.text[:200]}"
        return
    body = response.json()
    acc = _Choices(usage=body.get("usage"))
    for choice in body.get("choices") or []:
        _add_choice(acc, choice, plan)
    _finish(plan, acc, result)


async def _send_stream(client: Any, plan: SoakRequest, result: SoakResult,
                       start: float) -> None:
    acc, num_chunks, is_done = _Choices(), 0, False
    async with client.stream("POST", plan.path, json=plan.body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {text[:200]}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                is_done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = f"stream error: {str(chunk['error'])[:200]}"
                return
            if chunk.get("usage"):
                acc.usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if result.ttft_s is None and _has_token(choice):
                    result.ttft_s = time.perf_counter() - start
                _add_choice(acc, choice, plan)
            num_chunks += 1
            if plan.disconnect_after is not None and num_chunks >= plan.disconnect_after:
                # Leaving the `async with` closes the connection mid-stream.
                result.status = "disconnected"
                return
    if not is_done:
        result.error = "stream ended without [DONE]"
        return
    _finish(plan, acc, result)


def _finish(plan: SoakRequest, acc: _Choices, result: SoakResult) -> None:
    result.error = validate(plan, acc)
    if not result.error:
        result.status = "completed"
        result.output_tokens = (acc.usage or {}).get("completion_tokens", 0)


# ------------------------------------------------------------------ server stats

class StatsMonitor:
    """Reads GET /debug/stats on its own client; `samples` holds every good reading."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.samples: list[dict[str, Any]] = []

    async def read(self) -> dict[str, Any] | None:
        try:
            response = await self.client.get("/debug/stats")
            stats = response.json() if response.status_code == 200 else None
        except Exception:  # unreachable or not JSON: the run goes on without RSS
            return None
        if not isinstance(stats, dict) or "api_rss_bytes" not in stats:
            return None
        self.samples.append(stats)
        return stats

    async def poll(self, interval_s: float) -> None:
        """Read every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.read()

    async def wait_idle(self, timeout_s: float) -> dict[str, Any] | None:
        """The stats once nothing runs or waits (aborts of hung-up streams reach the
        engine a little after the client leaves), or the last reading at the timeout."""
        deadline = time.monotonic() + timeout_s
        stats = await self.read()
        while stats is not None and time.monotonic() < deadline:
            if (stats["num_running"] == stats["num_waiting"] == 0
                    and not stats.get("num_front_end_requests")):
                break
            await asyncio.sleep(0.2)
            stats = await self.read() or stats
        return stats


def rss_report(before: dict[str, Any] | None, samples: list[dict[str, Any]],
               after: dict[str, Any] | None) -> dict[str, Any] | None:
    """{"api" | "engine": {start, peak, end, growth}} in MB from the readings before the
    run, all `samples` (both ends included) and once idle after it; None without both."""
    if before is None or after is None:
        return None
    report: dict[str, Any] = {}
    for proc in ("api", "engine"):
        key = f"{proc}_rss_bytes"
        start, end = before.get(key), after.get(key)
        peak = max((s[key] for s in samples if s.get(key)), default=None)
        report[proc] = None if not (start and end and peak) else {
            "start": start / 2 ** 20, "peak": peak / 2 ** 20, "end": end / 2 ** 20,
            "growth": (end - start) / 2 ** 20}
    return report


def blocks_report(after: dict[str, Any] | None) -> dict[str, Any]:
    """KV blocks once idle: every block but the null ones (id 0 of each data parallel
    replica's pool) must be free again."""
    if after is None or "num_blocks" not in after:
        return dict.fromkeys(("num_kv_blocks", "num_free_kv_blocks", "leaked_blocks",
                              "is_server_idle"))
    num_pools = len(after.get("replicas") or [after])
    return {"num_kv_blocks": after["num_blocks"],
            "num_free_kv_blocks": after["num_free_blocks"],
            "leaked_blocks": after["num_blocks"] - num_pools - after["num_free_blocks"],
            "is_server_idle": after["num_running"] == after["num_waiting"] == 0}


# ------------------------------------------------------------------ running

async def run_soak(ns: argparse.Namespace, workload: list[BenchRequest],
                   headers: dict[str, str]) -> dict[str, Any]:
    import httpx

    base_url = ns.base_url.rstrip("/")
    limit = ns.max_concurrency or len(workload)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(ns.timeout)) as client, \
            httpx.AsyncClient(base_url=base_url, headers=headers,
                              timeout=httpx.Timeout(10.0)) as stats_client:
        model = ns.model or await fetch_model_name(client, base_url)
        plans = plan_requests(workload, ns.soak_max_tokens, model, ns.seed)
        monitor = StatsMonitor(stats_client)
        before = await monitor.read()
        poller = asyncio.create_task(monitor.poll(ns.stats_interval))
        start = time.perf_counter()
        try:
            results = await _send_all(ns, client, plans)
        finally:
            poller.cancel()
        duration = time.perf_counter() - start
        after = await monitor.wait_idle(IDLE_TIMEOUT_S)
    return {"base_url": ns.base_url, "model": model, "num_requests": len(plans),
            "max_concurrency": ns.max_concurrency, "request_rate": ns.request_rate,
            "seed": ns.seed, **aggregate(results, duration),
            "rss_mb": rss_report(before, monitor.samples, after),
            "num_stats_samples": len(monitor.samples), **blocks_report(after)}


async def _send_all(ns: argparse.Namespace, client: Any, plans: list[SoakRequest],
                    ) -> list[SoakResult]:
    """Every plan, at most --max-concurrency in flight, paced by --request-rate."""
    semaphore = asyncio.Semaphore(ns.max_concurrency or len(plans))
    rng = random.Random(ns.seed)

    async def limited(plan: SoakRequest) -> SoakResult:
        async with semaphore:
            return await send(client, plan)

    tasks = []
    for i, plan in enumerate(plans):
        if i and ns.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(ns.request_rate))
        tasks.append(asyncio.create_task(limited(plan)))
    return list(await asyncio.gather(*tasks))


def aggregate(results: list[SoakResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.status == "completed"]
    errors = list(dict.fromkeys(r.error for r in results if r.error))[:5]
    kinds: dict[str, dict[str, int]] = {}
    for r in results:
        counts = kinds.setdefault(r.kind, dict.fromkeys(
            ("count", "completed", "failed", "disconnected"), 0))
        counts["count"] += 1
        counts[r.status] += 1
    output = sum(r.output_tokens for r in done)
    statuses = [r.status for r in results]
    return {
        "completed": len(done), "failed": statuses.count("failed"),
        "disconnected": statuses.count("disconnected"), "errors": errors,
        "kinds": dict(sorted(kinds.items())), "duration_s": duration,
        "request_throughput": len(done) / duration, "total_output_tokens": output,
        "output_throughput": output / duration,
        **summarize([r.ttft_s for r in done if r.ttft_s is not None], "ttft_ms", 1e3),
        **summarize([r.e2e_s for r in done], "e2el_ms", 1e3),
    }


def run(ns: argparse.Namespace, headers: dict[str, str]) -> dict[str, Any]:
    workload = workload_from_args(ns, ns.random_vocab_size, default_num=1000)
    result = asyncio.run(run_soak(ns, workload, headers))
    emit(result, "serve --soak", summary(result))
    return result


def summary(r: dict[str, Any]) -> list[str]:
    lines = [f"requests:           {r['num_requests']}: {r['completed']} completed, "
             f"{r['disconnected']} disconnected, {r['failed']} failed in "
             f"{r['duration_s']:.2f} s",
             f"throughput:         {r['request_throughput']:.2f} req/s, "
             f"{r['output_throughput']:.1f} output tok/s"]
    for name, label in (("ttft_ms", "TTFT"), ("e2el_ms", "E2E latency")):
        lines.append(f"{label + ' (ms):':<20}mean {r[f'{name}_mean']:.1f}  median {r[name]:.1f}"
                     f"  p90 {r[f'{name}_p90']:.1f}  p99 {r[f'{name}_p99']:.1f}")
    lines.append("kinds (count/failed): " + ", ".join(
        f"{k} {c['count']}/{c['failed']}" for k, c in r["kinds"].items()))
    for proc, rss in (r["rss_mb"] or dict.fromkeys(("api", "engine"))).items():
        lines.append(f"{proc + ' RSS (MB):':<20}" + (
            "unavailable" if rss is None else
            f"start {rss['start']:.1f}  peak {rss['peak']:.1f}  end {rss['end']:.1f}  "
            f"growth {rss['growth']:+.1f}"))
    if r["leaked_blocks"] is not None:
        busy = "" if r["is_server_idle"] else ", server still busy"
        lines.append(f"KV blocks:          {r['num_free_kv_blocks']} of "
                     f"{r['num_kv_blocks'] - 1} free after the run "
                     f"({r['leaked_blocks']} leaked{busy})")
    return lines + [f"error: {error}" for error in r["errors"]]
