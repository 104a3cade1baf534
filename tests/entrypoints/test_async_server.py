"""The server with async scheduling (`--async-scheduling`, the default on CUDA), on CPU:
concurrent streams with stop strings, stop ids and different lengths give the same text,
token counts and finish reasons as a server that waits for each step; a client that
disconnects while a step is in flight for its request frees it and its blocks."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.entrypoints.utils import MODEL_NAME, RemoteServer

# Dequantized float32, as test_openai_server.py: both servers run the same kernels, which
# are batch invariant on CPU, so their outputs must be equal bit for bit.
SERVER_ARGS = ["--dtype", "float32", "--quantization", "none", "--max-model-len", "512",
               "--num-kv-blocks", "128", "--max-num-seqs", "16"]


@pytest.fixture(scope="module")
def servers():
    sync = RemoteServer(SERVER_ARGS + ["--no-async-scheduling"])
    try:
        overlapped = RemoteServer(SERVER_ARGS + ["--async-scheduling"])
    except BaseException:
        sync.stop()
        raise
    yield sync, overlapped
    overlapped.stop()
    sync.stop()


def _requests() -> list[dict]:
    """Greedy completions that end in every way: length (several max_tokens), a stop
    string, a stop id found in the first one's output below."""
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time",
               "def fibonacci(n):", "My favourite fruits are", "The weather today"]
    reqs = [dict(prompt=p, max_tokens=6 + 3 * i, temperature=0,
                 extra_body={"ignore_eos": True}) for i, p in enumerate(prompts)]
    reqs[1]["stop"] = [" 7"]
    return reqs


async def _stream_all(server: RemoteServer, reqs: list[dict]) -> list[tuple[str, int, str]]:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                max_retries=0, timeout=300)

    async def one(kw: dict) -> tuple[str, int, str]:
        stream = await client.completions.create(
            model=MODEL_NAME, stream=True, stream_options={"include_usage": True}, **kw)
        text, reason, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return text, usage.completion_tokens, reason

    return await asyncio.gather(*(one(kw) for kw in reqs))


def test_async_server_streams_equal_sync_server(servers):
    sync, overlapped = servers
    assert "async scheduling: each step" in overlapped.read_log()
    assert "async scheduling" not in sync.read_log()
    reqs = _requests()
    expected = asyncio.run(_stream_all(sync, reqs))
    # A stop id: the token of the 4th request's output after its first one.
    ids = httpx.post(sync.url + "/tokenize", json={"prompt": expected[3][0]}).json()["tokens"]
    reqs[3]["extra_body"] = {"ignore_eos": True, "stop_token_ids": [ids[1]]}
    expected = asyncio.run(_stream_all(sync, reqs))
    assert {reason for _, _, reason in expected} == {"length", "stop"}
    assert expected[3][2] == "stop" and expected[1][2] == "stop"
    assert asyncio.run(_stream_all(overlapped, reqs)) == expected


def test_async_server_disconnect_frees_request(servers):
    _, server = servers
    body = {"model": MODEL_NAME, "prompt": "Tell me a very long story.", "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert server.stats()["num_running"] == 1
    for _ in range(100):
        stats = server.stats()
        if stats["num_running"] == 0 and stats["num_front_end_requests"] == 0:
            break
        time.sleep(0.1)
    assert stats["num_running"] == 0 and stats["num_front_end_requests"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1
