"""Disaggregated prefill over HTTP: a prefill server (kv_producer), a decode server
(kv_consumer) sharing a directory (--kv-transfer-config), and `pagedllm disagg-proxy` in
front. Through the proxy a request gets the answer the prefill server alone would give
(greedy), with the decode server loading the prompt's blocks rather than computing them
(its external prefix-cache metrics), streamed or not; a refused request is refused with
the server's message; a prefill server that is down costs only speed."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from pagedllm.entrypoints.disagg_proxy import build_app, prefill_body, prefill_content
from tests.entrypoints.utils import MODEL_NAME, RemoteServer, free_port

PROMPT = ("The history of the Roman empire is long. It began with a small city on seven "
          "hills beside the Tiber, grew into a republic that ruled the Mediterranean, and "
          "became an empire whose roads, laws and language outlived it by many centuries. "
          "Historians still argue about why it fell.")


def _transfer(store, role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "ExampleConnector", "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(store)}}),
        "--max-model-len", "512"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    store = tmp_path_factory.mktemp("disagg_store")
    prefill = RemoteServer(_transfer(store, "kv_producer"))
    prefill.store = store
    decode = RemoteServer(_transfer(store, "kv_consumer"))
    port = free_port()
    proxy = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "disagg-proxy", "--port",
         str(port), "--prefill", prefill.url, "--decode", decode.url],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proxy.poll() is None and time.monotonic() < deadline, "proxy did not start"
        time.sleep(0.3)
    yield prefill, decode, url
    proxy.terminate()
    proxy.wait(10)
    decode.stop()
    prefill.stop()


def _metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^pagedllm:{name}_total{{[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_the_decode_server_loads_what_the_prefill_server_computed(servers):
    prefill, decode, url = servers
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    # The prefill server computed the prompt (its one token), the decode server loaded
    # every full block of it but the last token's.
    assert _metric(prefill, "prompt_tokens") == prompt_tokens
    assert _metric(decode, "external_prefix_cache_hits") == (prompt_tokens - 1) // 16 * 16
    alone = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60)
    assert r.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    assert "metrics" not in r.json()  # (only with --enable-per-request-metrics)


def test_a_streamed_chat_goes_through(servers):
    prefill, decode, url = servers
    body = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT + " Why did it fall?"}]}
    hits = _metric(decode, "external_prefix_cache_hits")
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) > 3
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in lines[:-1] if json.loads(line[6:])["choices"])
    alone = httpx.post(prefill.url + "/v1/chat/completions", json=body, timeout=60)
    assert text == alone.json()["choices"][0]["message"]["content"]
    assert _metric(decode, "external_prefix_cache_hits") > hits


def test_a_refused_request_is_refused_with_the_servers_message(servers):
    _, _, url = servers
    r = httpx.post(url + "/v1/completions", json={
        "model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "temperature": -1},
        timeout=30)
    assert r.status_code == 400 and "temperature" in r.text
    for raw in (b"{not json", b'{"prompt": "x", "max_tokens": NaN}', b"[" * 3000 + b"]" * 3000):
        r = httpx.post(url + "/v1/completions", content=raw,
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (raw[:40], r.text)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x" * (3 << 20)},
                   timeout=30)
    assert r.status_code == 413 and "--max-body-bytes" in r.text
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == MODEL_NAME


def test_a_prefill_server_that_is_down_costs_only_speed(servers):
    _, decode, _ = servers
    dead = f"http://127.0.0.1:{free_port()}"
    app = build_app([dead], [decode.url])

    async def ask():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            health = await c.get("/health")
            r = await c.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4},
                timeout=60)
            return health, r

    health, r = asyncio.run(ask())
    assert health.status_code == 503
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    # No decode server: a 502 saying so.
    app = build_app([decode.url], [dead])
    _, r = asyncio.run(ask())
    assert r.status_code == 502 and dead in r.json()["error"]["message"]


def test_reset_external_deletes_the_stored_blocks(servers):
    """vLLM's /reset_prefix_cache?reset_external=true: the model's blocks leave the
    store (a plain reset keeps them)."""
    prefill, _, url = servers
    assert list(prefill.store.rglob("*.kv"))  # from the tests before
    assert httpx.post(prefill.url + "/reset_prefix_cache").status_code == 200
    assert list(prefill.store.rglob("*.kv"))
    r = httpx.post(prefill.url + "/reset_prefix_cache", params={"reset_external": "true"})
    assert r.status_code == 200
    deadline = time.monotonic() + 30  # (the renamed folder is deleted on a thread)
    while (list((prefill.store / "pagedllm-kv").glob("*.deleting-*"))
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert not list(prefill.store.rglob("*.kv"))


def test_the_prefill_request():
    body = prefill_body({"prompt": "x", "max_tokens": 100, "max_completion_tokens": 100,
                         "stream": True, "stream_options": {"include_usage": True},
                         "n": 3, "temperature": 0.5})
    assert body == {"prompt": "x", "max_tokens": 1, "max_completion_tokens": 1,
                    "stream": False, "n": 1, "temperature": 0.5}
    with pytest.raises(ValueError, match="at least one --prefill"):
        build_app([], ["http://x"])
    # Bodies the proxy cannot rewrite go to the decode server alone (its 400).
    for raw in (b"{not json", b"[1]", b'{"prompt": "x", "top_p": NaN}',
                b'{"prompt": "x", "temperature": Infinity}', b"[" * 3000 + b"]" * 3000,
                b'{"a":' * 3000 + b"1" + b"}" * 3000):
        assert prefill_content(raw) is None
    assert json.loads(prefill_content(b'{"prompt": "\\ud800", "max_tokens": 9}')) == {
        "prompt": "\ud800", "max_tokens": 1, "stream": False, "n": 1}
