"""Killing the engine-core process: in-flight requests fail with a 5xx, /health turns
503, new requests get 503, and nothing hangs."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.utils import MODEL_NAME, RemoteServer

# A KV cache (23 usable blocks = 368 tokens) smaller than max_model_len.
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "24",
               "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS)
    yield srv
    srv.stop()


def test_prompt_larger_than_kv_cache_is_rejected_up_front(server):
    body = {"model": MODEL_NAME, "prompt": "hello " * 400, "max_tokens": 4, "stream": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "KV cache holds only 368" in r.json()["error"]["message"]


# Runs last in this module: it kills the engine.
def test_engine_death_fails_requests_and_health(server):
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 100,
            "ignore_eos": True}
    results: dict[str, object] = {}

    def non_streaming() -> None:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        results["plain"] = (r.status_code, r.json())

    def streaming() -> None:
        events = []
        with httpx.stream("POST", server.url + "/v1/completions",
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
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=5)
    assert r.status_code == 503
    r = httpx.post(server.url + "/v1/chat/completions", timeout=5,
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503
    # The HTTP side itself is still up.
    assert httpx.get(server.url + "/version", timeout=5).status_code == 200
