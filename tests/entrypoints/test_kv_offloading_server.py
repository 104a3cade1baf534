"""`pagedllm serve --kv-offloading-size` (vLLM's flag): a conversation whose prefix the
KV cache has forgotten gets the same answer, its prompt blocks loaded from the host tier
(the external prefix-cache metrics count them); /reset_prefix_cache?reset_external=true
empties the tier. The engine's side: tests/engine/test_kv_offloading.py."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.entrypoints.utils import MODEL_NAME, RemoteServer

MESSAGES = [{"role": "user", "content": (
    "The history of the Roman empire is long. It began with a small city on seven hills "
    "beside the Tiber, grew into a republic that ruled the Mediterranean, and became an "
    "empire whose roads, laws and language outlived it. Why did it fall?")}]


@pytest.fixture(scope="module")
def server():
    s = RemoteServer(["--kv-offloading-size", "0.25", "--max-model-len", "512"])
    yield s
    s.stop()


def _metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^pagedllm:{name}_total{{[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _chat(server: RemoteServer, messages) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL_NAME, "messages": messages, "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_forgotten_prefix_comes_back_from_the_host_tier(server):
    first = _chat(server, MESSAGES)
    assert _metric(server, "external_prefix_cache_hits") == 0
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    again = _chat(server, MESSAGES)
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert _metric(server, "external_prefix_cache_hits") == (prompt_tokens - 1) // 16 * 16
    # (A next turn's blocks of the answer are not asserted here: where the bundled
    # model computes prompt rows on other kernels (AMX), generated blocks hash apart
    # from the same tokens as a prompt. The tiny float32 model's test checks them.)

    r = httpx.post(server.url + "/reset_prefix_cache", params={"reset_external": "true"})
    assert r.status_code == 200
    hits = _metric(server, "external_prefix_cache_hits")
    assert _chat(server, MESSAGES)["choices"][0]["message"] \
        == first["choices"][0]["message"]
    assert _metric(server, "external_prefix_cache_hits") == hits
