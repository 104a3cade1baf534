"""`pagedllm bench throughput | latency | serve` on a tiny random Llama: each prints one
strict JSON object with its documented fields on stdout (summary on stderr)."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagedllm.entrypoints.cli import main
from tests.utils import save_tiny_model, tiny_llama_config

VOCAB = 96


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    cfg = tiny_llama_config(vocab_size=VOCAB, eos_token_id=1)
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_bench"), cfg))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("workload") / "work.json"
    items = [{"prompt_token_ids": [(7 * i + j) % VOCAB for j in range(5 + 3 * i)],
              "max_tokens": 4 + i} for i in range(6)]
    path.write_text(json.dumps(items))
    return str(path)


def run_cli(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)  # stdout is exactly one JSON document
    assert "=====" in out.err  # the readable summary went to stderr
    return result


def assert_finite(result: dict, keys: list[str]) -> None:
    for key in keys:
        assert isinstance(result[key], (int, float)) and math.isfinite(result[key]), key


ENGINE = ["--dtype", "float32", "--skip-tokenizer-init", "--num-kv-blocks", "64",
          "--max-model-len", "128"]
THROUGHPUT_FIELDS = ["elapsed_s", "requests_per_s", "output_tokens_per_s",
                     "total_tokens_per_s", "peak_rss_mb"]


def test_throughput_dataset(capsys, tiny_model, dataset):
    r = run_cli(capsys, ["bench", "throughput", "--model", tiny_model, "--dataset", dataset,
                         *ENGINE])
    assert_finite(r, THROUGHPUT_FIELDS)
    assert r["backend"] == "pagedllm" and r["num_requests"] == 6
    assert r["num_output_tokens"] == sum(4 + i for i in range(6))  # ignore_eos: exact


def test_throughput_random_both_backends(capsys, tiny_model):
    r = run_cli(capsys, ["bench", "throughput", "--model", tiny_model, "--backend", "both",
                         "--random-input-len", "9", "--random-output-len", "5",
                         "--num-prompts", "4", "--seed", "3", "--hf-batch-sizes", "1,4",
                         *ENGINE])
    assert_finite(r, THROUGHPUT_FIELDS + ["speedup_vs_hf"])
    assert r["num_requests"] == 4 and r["num_output_tokens"] == 20
    hf = r["hf"]
    assert hf["backend"] == "hf" and hf["hf_batch_size"] in (1, 4)
    assert_finite(hf, THROUGHPUT_FIELDS)
    assert hf["num_output_tokens"] == 20


def test_latency(capsys, tiny_model):
    r = run_cli(capsys, ["bench", "latency", "--model", tiny_model, "--input-len", "12",
                         "--output-len", "6", "--num-iters", "3", *ENGINE])
    assert_finite(r, ["ttft_s", "ttft_s_p90", "ttft_s_p99", "decode_tokens_per_s",
                      "decode_tokens_per_s_p90", "e2e_s", "e2e_s_p99", "startup_s"])
    assert r["num_iters"] == 3 and (r["input_len"], r["output_len"]) == (12, 6)
    assert 0 < r["ttft_s"] <= r["e2e_s"] < r["startup_s"] + r["e2e_s"]


def test_lora_path(capsys, tiny_model, dataset, tmp_path):
    """--lora-path: every request runs with the adapter (enable_lora turned on)."""
    from tests.utils import save_tiny_lora

    adapter = str(save_tiny_lora(tmp_path / "adapter", tiny_model))
    r = run_cli(capsys, ["bench", "throughput", "--model", tiny_model, "--dataset", dataset,
                         "--lora-path", adapter, *ENGINE])
    assert r["lora_path"] == adapter and r["num_output_tokens"] == sum(4 + i for i in range(6))
    r = run_cli(capsys, ["bench", "latency", "--model", tiny_model, "--input-len", "12",
                         "--output-len", "6", "--num-iters", "2", "--lora-path", adapter,
                         *ENGINE])
    assert r["lora_path"] == adapter
    assert_finite(r, ["ttft_s", "decode_tokens_per_s"])


class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams max_tokens one-token chunks per /v1/completions call (SSE), like a server."""

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        self._json(200, {"object": "list", "data": [{"id": "fake-model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or body.get("max_tokens") == 13:
            return self._json(400, {"error": {"message": "bad request"}})
        assert body["stream"] and body["ignore_eos"] and body["model"] == "fake-model"
        assert isinstance(body["prompt"], list)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            time.sleep(0.002)
            chunk = {"choices": [{"index": 0, "text": f" t{i}",
                                  "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                          "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("pacing", [["--request-rate", "200"], ["--max-concurrency", "2"]])
def test_serve_against_fake_server(capsys, fake_server, tmp_path, pacing):
    items = [{"prompt_token_ids": [1, 2, 3, i], "max_tokens": 3 + i} for i in range(5)]
    items.append({"prompt_token_ids": [4, 5], "max_tokens": 13})  # the server rejects it
    path = tmp_path / "w.json"
    path.write_text(json.dumps(items))
    r = run_cli(capsys, ["bench", "serve", "--base-url", fake_server, "--dataset", str(path),
                         *pacing])
    assert (r["completed"], r["failed"]) == (5, 1) and "HTTP 400" in r["errors"][0]
    assert r["model"] == "fake-model"
    assert r["total_output_tokens"] == sum(3 + i for i in range(5))
    assert_finite(r, ["duration_s", "request_throughput", "output_throughput",
                      "ttft_ms", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms", "tpot_ms_p99",
                      "itl_ms", "itl_ms_p90", "itl_ms_p99", "e2el_ms"])
    assert 0 < r["ttft_ms"] <= r["e2el_ms"]
