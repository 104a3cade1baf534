"""A live `pagedllm serve` in a subprocess, for tests that talk HTTP to it."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

MODEL_NAME = "SmolLM2-135M-Instruct"  # the served name of the bundled default model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m pagedllm.entrypoints.cli serve --port FREE ARGS...`, ready on enter."""

    def __init__(self, args: list[str], api_key: str | None = None,
                 startup_timeout_s: float = 300.0, key_in_env: bool = False,
                 ca_file: str | None = None, uds: str | None = None) -> None:
        """`key_in_env` passes the API key as PAGEDLLM_API_KEY instead of --api-key;
        `ca_file`: the server speaks HTTPS with a certificate this CA signed; `uds`:
        it listens on this Unix socket (given in `args`, or its --config file)."""
        self.port = free_port()
        self.uds = uds
        self.api_key = api_key
        self.scheme = "https" if ca_file else "http"
        # What httpx verifies the server's certificate with.
        self.verify = ssl.create_default_context(cafile=ca_file) if ca_file else True
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port",
               str(self.port), *args]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.pop("PAGEDLLM_API_KEY", None)
        if api_key and key_in_env:
            env["PAGEDLLM_API_KEY"] = api_key
        elif api_key:
            cmd += ["--api-key", api_key]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm-server-",
                                               suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy(startup_timeout_s)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.read_log()[-5000:]}")
            try:
                with self.client() as client:
                    if client.get("/health", timeout=2).status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        log = self.read_log()
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{log[-5000:]}")

    def client(self) -> httpx.Client:
        """An httpx client of the server (over its Unix socket with `uds`)."""
        if self.uds:
            return httpx.Client(transport=httpx.HTTPTransport(uds=self.uds),
                                base_url="http://localhost", headers=self.headers)
        return httpx.Client(base_url=self.url, verify=self.verify, headers=self.headers)

    def read_log(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def stats(self) -> dict:
        return httpx.get(self.url + "/debug/stats", headers=self.headers, timeout=10).json()

    def openai_client(self):
        """The official `openai` client for this server (no retries: a failure shows)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=120)

    def stop(self) -> None:
        """Stop the server and delete its log (idempotent)."""
        if self.log.closed:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        os.unlink(self.log.name)


HEALTH_PROBE = """
import http.client, json, os, sys, time
port, stop_file = int(sys.argv[1]), sys.argv[2]
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
latencies, end = [], time.monotonic() + 300
while not os.path.exists(stop_file) and time.monotonic() < end:
    start, t = time.monotonic(), time.perf_counter()
    conn.request("GET", "/health")
    response = conn.getresponse()
    response.read()
    latencies.append((time.perf_counter() - t, response.status, start))
    time.sleep(0.05)
print(json.dumps(latencies))
"""


class HealthProbe:
    """A separate process timing GET /health every 50 ms until `stop()` (the test's own
    event loop, busy parsing streams, would time itself rather than the server)."""

    def __init__(self, port: int) -> None:
        self._stop_file = tempfile.mktemp(prefix="pagedllm-probe-")
        self.proc = subprocess.Popen([sys.executable, "-c", HEALTH_PROBE, str(port),
                                      self._stop_file], stdout=subprocess.PIPE, text=True)

    def stop(self) -> list[tuple[float, int, float]]:
        """(latency in s, status, time.monotonic() at its start) of every probe."""
        open(self._stop_file, "w").close()
        try:
            out, _ = self.proc.communicate(timeout=60)
        finally:
            os.unlink(self._stop_file)
        return [tuple(x) for x in json.loads(out)]


def embedding_vectors(body: dict) -> list[np.ndarray]:
    """The vectors of a /v1/embeddings reply, float or base64 (little-endian float32)."""
    out = []
    for item in body["data"]:
        emb = item["embedding"]
        if isinstance(emb, str):
            out.append(np.frombuffer(base64.b64decode(emb), dtype="<f4"))
        else:
            out.append(np.array(emb, dtype=np.float32))
    return out
