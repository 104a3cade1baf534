"""`pagedllm bench serve --soak`: the request mix is planned exactly and repeatably, and a
short soak against the live bundled model completes every request without leaking KV
blocks, with the server's RSS reported."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pagedllm.bench.common import BenchRequest
from pagedllm.bench.soak import (KINDS, StatsMonitor, _Choices, allot_kinds, blocks_report,
                                 plan_requests, rss_report, validate)
from tests.bench.test_bench import run_cli
from tests.entrypoints.utils import RemoteServer

API_KEY = "soak-key"
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "128",
               "--max-num-seqs", "16", "--log-stats-interval", "0"]


def test_allot_kinds_exact_shares_and_seeded():
    kinds = allot_kinds(200, random.Random(0))
    counts = Counter(k.name for k in kinds)
    assert counts == {k.name: 2 * k.share for k in KINDS}  # shares are percentages
    assert kinds == allot_kinds(200, random.Random(0))
    assert kinds != allot_kinds(200, random.Random(1))
    # Every kind at least once as soon as there are enough requests.
    assert set(Counter(k.name for k in allot_kinds(len(KINDS), random.Random(0)))) == \
        {k.name for k in KINDS}
    assert len(allot_kinds(7, random.Random(0))) == 7


def test_plan_requests_bodies():
    workload = [BenchRequest([5, 6, 7], 100) for _ in range(100)]
    plans = plan_requests(workload, 16, "m", seed=3)
    by_kind = {p.kind: p for p in plans}
    assert set(by_kind) == {k.name for k in KINDS}
    assert all(p.max_tokens == p.body["max_tokens"] == 16 for p in plans)
    n_body = by_kind["cmpl_n"].body
    assert n_body["n"] in (2, 3) and n_body["temperature"] == 0.8 and "seed" in n_body
    assert by_kind["chat_stop"].body["stop"] == ["\n", "."]
    assert by_kind["cmpl_logprobs"].body["logprobs"] == 2
    assert by_kind["chat_logprobs_stream"].body["top_logprobs"] == 2
    assert by_kind["chat_stream"].body["stream_options"] == {"include_usage": True}
    assert by_kind["chat"].body["messages"][0]["content"]
    assert by_kind["cmpl"].body["prompt"] == [5, 6, 7]
    assert by_kind["disconnect"].disconnect_after in (2, 3, 4)


def test_validate_catches_bad_responses():
    plan = plan_requests([BenchRequest([1, 2], 4)] * 20, 4, None, seed=0)[0]
    plan.n, plan.num_prompt_tokens, plan.stop, plan.num_top = 2, 2, None, None
    good = _Choices(text={0: "a", 1: "b"}, finish_reason={0: "length", 1: "stop"},
                    usage={"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8})
    assert validate(plan, good) == ""
    assert "indexes" in validate(plan, _Choices(text={0: "a"}, finish_reason={0: "stop"},
                                                usage=good.usage))
    bad_usage = dict(good.usage, completion_tokens=3, total_tokens=5)  # < one length choice
    assert "completion_tokens" in validate(plan, _Choices(good.text, good.finish_reason,
                                                          usage=bad_usage))
    plan.stop = ["."]
    assert "stop string" in validate(plan, _Choices({0: "a.", 1: "b"}, good.finish_reason,
                                                    usage=good.usage))


def test_rss_report_null_without_stats():
    stats = {"api_rss_bytes": 2 ** 20, "engine_rss_bytes": 3 * 2 ** 20}
    peak = dict(stats, engine_rss_bytes=5 * 2 ** 20)
    assert rss_report(None, [], stats) is None
    report = rss_report(stats, [stats, peak, stats], stats)
    assert report["engine"] == {"start": 3.0, "peak": 5.0, "end": 3.0, "growth": 0.0}


def test_blocks_report_counts_a_null_block_per_replica():
    idle = {"num_blocks": 128, "num_free_blocks": 127, "num_running": 0, "num_waiting": 0}
    assert blocks_report(idle)["leaked_blocks"] == 0
    # Two data parallel replicas of 64 blocks: two null blocks.
    replicas = dict(idle, num_free_blocks=126, replicas=[{}, {}])
    assert blocks_report(replicas)["leaked_blocks"] == 0
    assert blocks_report(dict(replicas, num_free_blocks=125))["leaked_blocks"] == 1


def test_stats_monitor_unreachable():
    import asyncio

    import httpx

    async def read() -> object:
        async with httpx.AsyncClient(base_url="http://127.0.0.1:9", timeout=1) as client:
            return await StatsMonitor(client).read()

    assert asyncio.run(read()) is None


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS, api_key=API_KEY)
    yield srv
    srv.stop()


def test_soak_against_live_server(capsys, server):
    r = run_cli(capsys, ["bench", "serve", "--soak", "--base-url", server.url,
                         "--api-key", API_KEY, "--num-prompts", "40",
                         "--max-concurrency", "8", "--random-input-len", "12",
                         "--random-output-len", "6", "--random-vocab-size", "49152",
                         "--stats-interval", "1"])
    assert r["num_requests"] == 40 and r["failed"] == 0, r["errors"]
    assert r["completed"] + r["disconnected"] == 40 and r["disconnected"] > 0
    assert set(r["kinds"]) == {k.name for k in KINDS}
    assert sum(c["count"] for c in r["kinds"].values()) == 40
    assert r["leaked_blocks"] == 0 and r["is_server_idle"]
    assert r["num_kv_blocks"] == 128
    for proc in ("api", "engine"):
        rss = r["rss_mb"][proc]
        assert all(isinstance(rss[k], float) and rss[k] > 0 for k in ("start", "peak", "end"))
        assert rss["peak"] >= max(rss["start"], rss["end"])
    assert 0 < r["ttft_ms"] <= r["e2el_ms_p99"]
    assert r["total_output_tokens"] > 0 and r["output_throughput"] > 0
