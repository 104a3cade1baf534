"""vLLM's development routes (--enable-dev-endpoints): POST /pause (modes abort, wait,
keep) and /resume, GET /is_paused, POST /collective_rpc. A scripted model (tests/utils.py)
recites "a b a b ..." after "go", so every answer is known word for word."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.entrypoints.utils import RemoteServer
from tests.utils import save_scripted_llama

SCRIPT = {"go": "a", "a": "b", "b": "a"}
EXT = "tests.engine.test_collective_rpc:WeightProbe"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_scripted_llama(tmp_path_factory.mktemp("scripted"), SCRIPT)
    srv = RemoteServer([str(path), "--dtype", "float32", "--max-model-len", "2048",
                        "--num-kv-blocks", "512", "--enable-dev-endpoints",
                        "--worker-extension-cls", EXT])
    yield srv
    srv.stop()


def _expected(n: int) -> str:
    return "".join(" a" if i % 2 == 0 else " b" for i in range(n))


class Stream(threading.Thread):
    """A streamed completion read in a thread: its pieces of text, as they come."""

    def __init__(self, server: RemoteServer, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = server.url, max_tokens
        self.text, self.finish_reason = "", None
        self.start()

    def run(self) -> None:
        import json
        body = {"prompt": "go", "max_tokens": self.max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    self.text += choice["text"]
                    self.finish_reason = choice["finish_reason"] or self.finish_reason

    def wait_for_tokens(self, n: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.text.split()) < n and self.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.005)


class Request(threading.Thread):
    """A non-streamed completion sent in a thread (it may have to wait)."""

    def __init__(self, server: RemoteServer, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.response = server.url, max_tokens, None
        self.start()

    def run(self) -> None:
        self.response = httpx.post(self.url + "/v1/completions", timeout=120, json={
            "prompt": "go", "max_tokens": self.max_tokens, "ignore_eos": True,
            "temperature": 0}).json()


def _post(server: RemoteServer, path: str, **params) -> dict:
    r = httpx.post(server.url + path, params=params, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _is_paused(server: RemoteServer) -> bool:
    return httpx.get(server.url + "/is_paused", timeout=30).json()["is_paused"]


def test_pause_abort_ends_what_runs_and_holds_what_comes(server):
    stream = Stream(server, 1500)
    stream.wait_for_tokens(10)
    assert _post(server, "/pause") == {"status": "paused"}
    stream.join(30)
    assert stream.finish_reason == "abort"
    assert stream.text == _expected(len(stream.text.split()))  # its tokens until then
    assert _is_paused(server)
    waiting = Request(server, 6)
    time.sleep(0.5)
    assert waiting.response is None  # taken, held
    assert _post(server, "/resume") == {"status": "resumed"}
    waiting.join(30)
    assert waiting.response["choices"][0]["text"] == _expected(6)
    assert not _is_paused(server)


def test_pause_wait_answers_once_the_requests_finished(server):
    stream = Stream(server, 300)
    stream.wait_for_tokens(5)
    _post(server, "/pause", mode="wait", clear_cache="false")
    # Answered once the request ran to its end (nothing runs any more), untouched.
    assert httpx.get(server.url + "/debug/stats", timeout=30).json()["num_running"] == 0
    stream.join(30)
    assert (stream.finish_reason, stream.text) == ("length", _expected(300))
    waiting = Request(server, 4)
    time.sleep(0.5)
    assert waiting.response is None
    _post(server, "/resume")
    waiting.join(30)
    assert waiting.response["choices"][0]["text"] == _expected(4)


def test_pause_keep_freezes_requests_where_they_are(server):
    stream = Stream(server, 1200)
    stream.wait_for_tokens(10)
    _post(server, "/pause", mode="keep")
    # What was on its way arrives; then nothing more (unfrozen, the 1,200 tokens would
    # all come in a few seconds).
    frozen, deadline = stream.text, time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.3)
        if stream.text == frozen:
            break
        frozen = stream.text
    time.sleep(1.0)
    assert stream.text == frozen and stream.finish_reason is None
    assert len(frozen.split()) < 1200
    assert _is_paused(server)
    _post(server, "/resume")
    stream.join(60)
    assert (stream.finish_reason, stream.text) == ("length", _expected(1200))


def test_bad_pause_mode_and_collective_rpc(server):
    r = httpx.post(server.url + "/pause", params={"mode": "later"}, timeout=30)
    assert r.status_code == 400 and "pause mode" in r.json()["error"]["message"]
    assert not _is_paused(server)

    def rpc(body: dict) -> httpx.Response:
        return httpx.post(server.url + "/collective_rpc", json=body, timeout=60)

    assert rpc({"method": "remember", "args": [41]}).json() == {"results": [None]}
    assert rpc({"method": "recall"}).json() == {"results": [41]}
    r = rpc({"method": "no_such_method"})
    assert r.status_code == 400 and "no_such_method" in r.json()["error"]["message"]
    r = rpc({"method": ""})
    assert r.status_code == 400
    for name in ("__class__", "_private", "model.forward"):
        r = rpc({"method": name})
        assert r.status_code == 400 and "public worker method" in r.json()["error"]["message"]
    r = rpc({"method": "recall", "timeout": 1e-9})  # the call runs on; the answer waits
    assert r.status_code == 408 and "did not answer" in r.json()["error"]["message"]
    r = rpc({"method": "recall", "shell": "rm -rf /"})
    assert r.status_code == 400 and "shell" in r.json()["error"]["message"]


def test_dev_routes_are_off_by_default(tmp_path):
    path = save_scripted_llama(tmp_path / "m", SCRIPT)
    srv = RemoteServer([str(path), "--dtype", "float32", "--max-model-len", "64",
                        "--num-kv-blocks", "16"])
    try:
        for method, route in (("POST", "/pause"), ("POST", "/resume"),
                              ("GET", "/is_paused"), ("POST", "/collective_rpc")):
            assert httpx.request(method, srv.url + route, timeout=30).status_code == 404
    finally:
        srv.stop()


@pytest.mark.parametrize("mode", ["wait", "keep"])
def test_requests_time_out_while_paused(server, mode):
    """A held (or frozen) request's deadline passes while no step runs: it is answered
    with its 408 then, not at resume."""
    _post(server, "/pause", mode=mode)
    start = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "prompt": "go", "max_tokens": 4, "temperature": 0, "timeout": 1.0})
    waited = time.monotonic() - start
    assert r.status_code == 408, r.text
    assert 0.9 < waited < 5, waited
    assert _is_paused(server)
    _post(server, "/resume")
    ok = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "prompt": "go", "max_tokens": 4, "temperature": 0}).json()
    assert ok["choices"][0]["text"] == _expected(4)
