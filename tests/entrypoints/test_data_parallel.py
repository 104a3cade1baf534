"""A server with two data parallel replicas (--data-parallel-size 2): each an engine-core
process pinned to its own core, requests spread over both, a request's tokens and
logprobs the same on either, an n > 1 fan-out kept on one replica, aborts freeing the
right replica's blocks, stats and the dashboard's grid over both, and one replica's death
failing the whole server."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from pagedllm.engine.dp_placement import physical_cores
from tests.entrypoints.utils import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.skipif(
    len(physical_cores(os.sched_getaffinity(0))) < 2,
    reason="two replicas need two physical cores")

# 64 blocks (63 usable) per replica.
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "64",
               "--data-parallel-size", "2", "--metrics-without-key", "--enable-sleep-mode"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS)
    yield srv
    srv.stop()


def _complete(server, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME} | body,
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _concurrently(fn, args: list) -> list:
    results: list = [None] * len(args)

    def run(i: int) -> None:
        results[i] = fn(args[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
        time.sleep(0.05)  # in order: the router sees the ones before as live
    for t in threads:
        t.join()
    return results


def _replicas(server) -> list[dict]:
    return server.stats()["replicas"]


def test_replicas_run_on_their_own_cores(server):
    stats = server.stats()
    replicas = stats["replicas"]
    assert len(replicas) == 2
    masks = [os.sched_getaffinity(r["engine_pid"]) for r in replicas]
    assert masks[0] and masks[1] and not masks[0] & masks[1]
    assert masks[0] | masks[1] <= os.sched_getaffinity(0)
    # Every thread of a replica (torch's pool included) is pinned.
    for r, mask in zip(replicas, masks):
        for tid in os.listdir(f"/proc/{r['engine_pid']}/task"):
            assert os.sched_getaffinity(int(tid)) == mask
    # The engine's totals are the replicas' sums.
    assert stats["num_blocks"] == 128 and stats["num_free_blocks"] == 126


def test_same_tokens_and_logprobs_on_either_replica(server):
    body = {"prompt": "The history of the printing press", "max_tokens": 24,
            "temperature": 0, "logprobs": 3, "ignore_eos": True}
    before = [r["prefix_cache_queries"] for r in _replicas(server)]
    # Two at once: the second goes to the replica the first left idle.
    first, second = _concurrently(lambda b: _complete(server, b), [body, body])
    after = [r["prefix_cache_queries"] for r in _replicas(server)]
    assert after[0] > before[0] and after[1] > before[1]
    a, b = first["choices"][0], second["choices"][0]
    assert a["text"] == b["text"] and a["logprobs"] == b["logprobs"]


def test_load_spreads_and_outputs_match_sequential(server):
    prompts = [f"Write a list of {i} fruits:" for i in range(6)]
    sequential = [_complete(server, {"prompt": p, "max_tokens": 12, "temperature": 0})
                  for p in prompts]
    before = [r["prefix_cache_queries"] for r in _replicas(server)]
    together = _concurrently(
        lambda p: _complete(server, {"prompt": p, "max_tokens": 12, "temperature": 0}),
        prompts)
    after = [r["prefix_cache_queries"] for r in _replicas(server)]
    # Six prompts of about the same length: three on each replica.
    num_tokens = sum(out["usage"]["prompt_tokens"] for out in together)
    assert after[0] - before[0] + after[1] - before[1] == num_tokens
    assert abs((after[0] - before[0]) - (after[1] - before[1])) <= num_tokens // 3
    assert [o["choices"][0]["text"] for o in together] == \
        [o["choices"][0]["text"] for o in sequential]


def test_fan_out_stays_on_one_replica(server):
    prompt = "Once upon a time in a land far away there lived a " * 4
    before = _replicas(server)
    out = _complete(server, {"prompt": prompt, "max_tokens": 8, "n": 4, "temperature": 1.0,
                             "seed": 7})
    after = _replicas(server)
    assert len(out["choices"]) == 4
    prompt_tokens = out["usage"]["prompt_tokens"]
    full_blocks = prompt_tokens // 16
    queried = [a["prefix_cache_queries"] - b["prefix_cache_queries"]
               for a, b in zip(after, before)]
    hits = [a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before)]
    # All four samples on one replica: the three siblings hit the leader's full blocks.
    used = 0 if queried[0] else 1
    assert queried[used] == 4 * prompt_tokens and queried[1 - used] == 0
    assert hits[used] == 3 * full_blocks * 16


def test_a_shared_prompt_beginning_stays_on_its_replica(server):
    """A request whose prompt begins as a live one's goes to that replica while it is
    not much busier than the idle one, and hits the cached blocks there."""
    system = "You are a careful assistant who answers every question in one word. " * 8
    before = _replicas(server)
    body = {"model": MODEL_NAME, "prompt": system + "First question?", "max_tokens": 40,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        second = _complete(server, {"prompt": system + "Second one?", "max_tokens": 4})
        assert "data: [DONE]" in list(lines)
    after = _replicas(server)
    queried = [a["prefix_cache_queries"] - b["prefix_cache_queries"]
               for a, b in zip(after, before)]
    hits = [a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before)]
    used = 0 if queried[0] else 1
    assert queried[1 - used] == 0  # both on one replica, though the other was idle
    shared_blocks = (second["usage"]["prompt_tokens"] - 4) // 16
    assert hits[used] >= shared_blocks * 16 >= 64


def test_aborted_streams_free_both_replicas(server):
    def stream_and_leave(i: int) -> None:
        body = {"model": MODEL_NAME, "prompt": f"Tell story number {i}.", "max_tokens": 300,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # closing the stream is a disconnect: the request is aborted

    _concurrently(stream_and_leave, list(range(4)))
    deadline = time.monotonic() + 30
    while True:
        stats = server.stats()
        if stats["num_running"] == 0 and stats["num_free_blocks"] == 126:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    assert all(r["num_running"] == 0 and r["num_waiting"] == 0 for r in stats["replicas"])
    assert stats["num_front_end_requests"] == 0


def test_dashboard_grid_shows_both_pools(server):
    state = httpx.get(server.url + "/dashboard/state", timeout=30).json()
    kv = state["kv"]
    assert kv["num_blocks"] == 128
    assert kv["num_free"] + kv["num_cached"] + kv["num_in_use"] == 126
    assert state["stats"]["num_blocks"] == 128


def test_both_replicas_sleep_and_wake(server):
    assert httpx.post(server.url + "/sleep", params={"level": 2}, timeout=60).status_code == 200
    assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": True}
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503
    assert httpx.post(server.url + "/wake_up", timeout=120).status_code == 200
    assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": False}
    # Both replicas serve again: two requests at once land on both.
    outs = _concurrently(lambda p: _complete(server, {"prompt": p, "max_tokens": 4,
                                                      "temperature": 0}), ["a b", "a b"])
    assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]


# Runs last in this module: it kills a replica.
def test_one_replica_dying_fails_the_server(server):
    pid = _replicas(server)[1]["engine_pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health", timeout=5).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r = httpx.get(server.url + "/health", timeout=5)
    assert r.status_code == 503
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503
    assert "data parallel replica 1" in r.json()["error"]["message"]
