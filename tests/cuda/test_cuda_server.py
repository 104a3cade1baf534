"""`pagedllm serve` on device "cuda": a tiny random Llama with a real (byte-fallback BPE)
tokenizer served by tests/entrypoints' RemoteServer; one /v1/completions request."""

from __future__ import annotations

import httpx
import pytest

from tests.cuda.helpers import CUDA_MARKS
from tests.engine.test_stop_strings import byte_fallback_tokenizer
from tests.entrypoints.utils import RemoteServer
from tests.utils import save_tiny_model, tiny_llama_config

pytestmark = CUDA_MARKS

NAME = "tiny-cuda"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_tokenizer")
    tokenizer = byte_fallback_tokenizer()
    save_tiny_model(path, tiny_llama_config(vocab_size=len(tokenizer)))
    tokenizer.save_pretrained(path)
    srv = RemoteServer([str(path), "--device", "cuda", "--dtype", "float32",
                        "--max-model-len", "256", "--num-kv-blocks", "64",
                        "--max-num-seqs", "8", "--served-model-name", NAME],
                       startup_timeout_s=240)
    yield srv
    srv.stop()


def test_completion_on_cuda(server):
    body = {"model": NAME, "prompt": "hello the world", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    reply = r.json()
    choice = reply["choices"][0]
    assert isinstance(choice["text"], str)
    assert choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    # The same request again: the same greedy text.
    again = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == choice["text"]
