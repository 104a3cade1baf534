"""A server over two pipeline stages (worker processes) of the bundled model: it serves,
and when one worker dies the next request gets a 503, /health turns 503, and shutting the
server down leaves no worker behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from tests.distributed.helpers import worker_processes
from tests.entrypoints.utils import MODEL_NAME, RemoteServer

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
               "--pipeline-parallel-size", "2"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS)
    yield srv
    srv.stop()


def _complete(server: RemoteServer, prompt: str) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def test_pipeline_server_serves_then_fails_loudly_when_a_worker_dies(server):
    # Greedy text equals what the one-process engine gives for the same prompt.
    from pagedllm import LLM, SamplingParams

    r = _complete(server, "The capital of France is")
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["text"]
    # Pipeline stages run the GGUF blocks too (their Python layers give the fused
    # stack's bits).
    llm = LLM(dtype="float32", max_model_len=256)
    try:
        local = llm.generate(["The capital of France is"],
                             SamplingParams(temperature=0, max_tokens=8),
                             use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()
    assert served == local

    workers = worker_processes(server.proc.pid)
    assert len(workers) == 2
    os.kill(workers[1].pid, signal.SIGKILL)
    start = time.monotonic()
    r = _complete(server, "Hello")
    assert r.status_code == 503, r.text
    assert "worker" in r.json()["error"]["message"]
    assert time.monotonic() - start < 30
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 503
    server.stop()
    assert server.proc.poll() is not None
    assert all(not w.is_running() or w.status() == psutil.STATUS_ZOMBIE for w in workers)
