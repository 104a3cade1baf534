"""Cohere's POST /v2/embed (as vLLM serves it) on a tiny random BERT with
sentence-transformers prompts: each embedding type is the /v1/embeddings vector of the
same tokens, input_type puts its prompt first, truncate cuts at max_tokens with the
special tokens kept."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest

from tests.entrypoints.utils import RemoteServer
from tests.utils import save_tiny_bert

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France!", "Hello"]
PROMPTS = {"search_query": "query: ", "search_document": "passage: "}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_tiny_bert(tmp_path_factory.mktemp("cohere_bert"))
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    srv = RemoteServer([str(path), "--dtype", "float32", "--served-model-name", "bert",
                        "--log-stats-interval", "0"])
    yield srv
    srv.stop()


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=120)


def _openai(server, inputs) -> np.ndarray:
    r = _post(server, "/v1/embeddings", {"input": inputs})
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def _ids(server, text: str, special: bool) -> list[int]:
    return _post(server, "/tokenize", {"prompt": text,
                                       "add_special_tokens": special}).json()["tokens"]


def test_every_type_is_the_embedding(server):
    r = _post(server, "/v2/embed", {"model": "bert", "texts": TEXTS,
                                    "embedding_types": ["float", "binary", "ubinary",
                                                        "base64"]})
    assert r.status_code == 200, r.text
    body = r.json()
    want = _openai(server, TEXTS)
    got = np.array(body["embeddings"]["float"], dtype=np.float32)
    np.testing.assert_allclose(got, want, atol=1e-6)
    unpacked = [np.frombuffer(base64.b64decode(b), dtype="<f4") for b in
                body["embeddings"]["base64"]]
    np.testing.assert_array_equal(np.stack(unpacked), got)
    bits = np.packbits(got >= 0, axis=-1).astype(np.int16)
    assert body["embeddings"]["ubinary"] == bits.tolist()
    assert body["embeddings"]["binary"] == (bits - 128).tolist()
    assert body["texts"] == TEXTS and body["response_type"] == "embeddings_by_type"
    assert body["meta"]["api_version"]["version"] == "2"
    assert body["meta"]["billed_units"]["input_tokens"] == sum(
        len(_ids(server, t, True)) for t in TEXTS)
    # Floats by default.
    only = _post(server, "/v2/embed", {"texts": TEXTS[:1]}).json()["embeddings"]
    assert set(k for k, v in only.items() if v is not None) == {"float"}


def test_input_type_puts_its_prompt_first(server):
    for kind, prompt in PROMPTS.items():
        r = _post(server, "/v2/embed", {"texts": TEXTS, "input_type": kind})
        got = np.array(r.json()["embeddings"]["float"], dtype=np.float32)
        np.testing.assert_allclose(got, _openai(server, [prompt + t for t in TEXTS]),
                                   atol=1e-6)
    r = _post(server, "/v2/embed", {"texts": TEXTS, "input_type": "clustering"})
    assert r.status_code == 400 and "search_document, search_query" in r.text


@pytest.mark.parametrize("truncate", ["END", "START"])
def test_truncation_keeps_the_special_tokens(server, truncate):
    text = TEXTS[1]
    full, body = _ids(server, text, True), _ids(server, text, False)
    kept = body[:3] if truncate == "END" else body[-3:]
    ids = [full[0], *kept, full[-1]]  # [CLS] ... [SEP]
    r = _post(server, "/v2/embed", {"texts": [text], "max_tokens": 5, "truncate": truncate})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["embeddings"]["float"], dtype=np.float32),
                               _openai(server, [ids]), atol=1e-6)
    assert r.json()["meta"]["billed_units"]["input_tokens"] == 5
    # What fits is not cut.
    r = _post(server, "/v2/embed", {"texts": [text], "max_tokens": len(full),
                                    "truncate": truncate})
    np.testing.assert_allclose(np.array(r.json()["embeddings"]["float"], dtype=np.float32),
                               _openai(server, [text]), atol=1e-6)


def test_what_it_refuses(server):
    long = " ".join(["cat"] * 100)  # past the 64 positions
    for fields, named in (({"texts": []}, "texts"),
                          ({"images": ["data:image/png;base64,AAAA"]}, "images"),
                          ({"inputs": [{"content": [{"type": "text", "text": "a"}]}]},
                           "inputs"),
                          ({"texts": ["a"], "output_dimension": 32}, "output_dimension"),
                          ({"texts": ["a"], "embedding_types": ["int8"]}, "embedding_types"),
                          ({"texts": [long], "truncate": "NONE"}, "truncate is NONE"),
                          ({"texts": ["a b c"], "max_tokens": 2, "truncate": "NONE"},
                           "max_tokens"),
                          ({"texts": ["a"], "max_tokens": 1}, "special tokens"),
                          ({"texts": ["a"], "model": "other"}, "other"),
                          ({"texts": ["a"], "unknown": 1}, "unknown")):
        r = _post(server, "/v2/embed", fields)
        assert r.status_code in (400, 404) and named in r.text, (fields, r.text)
    # END (the default) cuts a long text to the context instead.
    r = _post(server, "/v2/embed", {"texts": [long]})
    assert r.status_code == 200 and r.json()["meta"]["billed_units"]["input_tokens"] == 64
