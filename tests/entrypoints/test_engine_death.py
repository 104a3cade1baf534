"""Killing the engine-core process: in-flight requests fail with a 5xx, /health turns
503, new requests get 503, /metrics shows a dead engine, and nothing hangs."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.utils import MODEL_NAME, RemoteServer

# A KV cache (23 usable blocks = 368 tokens) smaller than max_model_len.
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "24",
               "--max-num-seqs", "4", "--metrics-without-key", "--log-stats-interval", "0.5"]
API_KEY = "death-key"


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS, api_key=API_KEY)
    yield srv
    srv.stop()


def test_prompt_larger_than_kv_cache_is_rejected_up_front(server):
    body = {"model": MODEL_NAME, "prompt": "hello " * 400, "max_tokens": 4, "stream": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30,
                   headers=server.headers)
    assert r.status_code == 400 and "KV cache holds only 368" in r.json()["error"]["message"]


# Runs last in this module: it kills the engine.
def test_engine_death_fails_requests_and_health(server):
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 100,
            "ignore_eos": True}
    results: dict[str, object] = {}

    def non_streaming() -> None:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60,
                       headers=server.headers)
        results["plain"] = (r.status_code, r.json())

    def streaming() -> None:
        events = []
        with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers,
                          json=body | {"stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    if len(events) == 1:
                        results["stream_started"] = True
        results["stream"] = events

    threads = [threading.Thread(target=non_streaming), threading.Thread(target=streaming)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not (results.get("stream_started") and server.stats()["num_running"] == 2):
        assert time.monotonic() < deadline, "requests never started"
        time.sleep(0.1)

    assert _metrics(server)["pagedllm:engine_alive"] == 1
    os.kill(server.stats()["engine_pid"], signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a request hung after the engine died"

    status, payload = results["plain"]
    assert status >= 500 and payload["error"]["code"] == status
    events = results["stream"]
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2]

    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["error"]["code"] == 503
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=5,
                   headers=server.headers)
    assert r.status_code == 503
    r = httpx.post(server.url + "/v1/chat/completions", timeout=5, headers=server.headers,
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503
    r = httpx.post(server.url + "/v1/embeddings", timeout=5, headers=server.headers,
                   json={"input": ["hi", "there"]})
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    # The HTTP side itself is still up.
    assert httpx.get(server.url + "/version", timeout=5,
                     headers=server.headers).status_code == 200
    # /metrics (open: --metrics-without-key) shows the engine gone, nothing running.
    metrics = _metrics(server)
    assert metrics["pagedllm:engine_alive"] == 0
    for gauge in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
                  "pagedllm:kv_cache_usage_perc"):
        assert metrics[gauge] == 0, gauge
    # The periodic stats line (every 0.5 s) stops with the engine.
    num_lines = server.read_log().count("Avg prompt throughput")
    time.sleep(1.5)
    assert server.read_log().count("Avg prompt throughput") == num_lines


def _metrics(server: RemoteServer) -> dict[str, float]:
    r = httpx.get(server.url + "/metrics", timeout=5)
    assert r.status_code == 200
    return {s.name: s.value for family in text_string_to_metric_families(r.text)
            for s in family.samples}
