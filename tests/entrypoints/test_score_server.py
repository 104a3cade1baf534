"""/score and /rerank served by a tiny random cross-encoder (float32): the scores equal
LLM.score's, rerank orders by them (top_n, return_documents), and long pairs are 400s
unless truncated; /classify served by a three-label classifier equals LLM.classify."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.entrypoints.utils import RemoteServer
from tests.utils import save_tiny_cross_encoder

NAME = "tiny-ce"
QUERY = "the cat sat on the mat"
DOCS = ["a dog is playing guitar", "the man is on the mat, the cat sat", "hello world",
        "paris is the capital of france"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_cross_encoder(tmp_path_factory.mktemp("served_ce"))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = RemoteServer([str(model_dir), "--dtype", "float32", "--served-model-name", NAME,
                        "--log-stats-interval", "0"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    from pagedllm import LLM

    llm = LLM(str(model_dir), dtype="float32")
    scores = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    llm.shutdown()
    return scores


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json={"model": NAME, **body}, timeout=120)


def test_score_matches_offline(server, offline):
    for route in ("/score", "/v1/score"):
        r = _post(server, route, {"text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == NAME and body["id"].startswith("score")
        assert [d["score"] for d in body["data"]] == pytest.approx(offline, abs=1e-6)
    pairwise = _post(server, "/v1/score", {"text_1": [QUERY, DOCS[0]],
                                           "text_2": [DOCS[1], DOCS[1]]}).json()
    assert pairwise["data"][0]["score"] == pytest.approx(offline[1], abs=1e-6)


def test_rerank_orders_by_score(server, offline):
    order = sorted(range(len(DOCS)), key=lambda i: -offline[i])
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = _post(server, route, {"query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order
        assert [x["relevance_score"] for x in results] == pytest.approx(
            [offline[i] for i in order], abs=1e-6)
    top = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1,
                                      "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == order[:1]
    assert top["results"][0].get("document") is None and top["usage"]["total_tokens"] > 0


def test_long_pairs_need_truncation(server):
    long = " ".join(["the cat sat on the mat"] * 20)  # past the 64 positions
    r = _post(server, "/v1/score", {"text_1": QUERY, "text_2": long})
    assert r.status_code == 400 and "pair 0" in r.json()["error"]["message"]
    r = _post(server, "/v1/score", {"text_1": QUERY, "text_2": long,
                                    "truncate_prompt_tokens": 48})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 48


def test_a_cross_encoder_does_not_embed_or_generate(server):
    r = _post(server, "/v1/embeddings", {"input": "hello"})
    assert r.status_code == 400 and "cross-encoder" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 400


def test_classify_on_a_cross_encoder_scores_single_texts(server):
    """As vLLM's classification models: one label classifies too (a reward model's use),
    its one "probability" the head's score of the text alone."""
    r = _post(server, "/classify", {"input": ["hello", "hello world"]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["num_classes"] for d in data] == [1, 1]
    assert data[0]["probs"] != data[1]["probs"]
    r = _post(server, "/v1/embeddings", {"input": "hello"})
    assert r.status_code == 400 and "is a cross-encoder" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = save_tiny_cross_encoder(tmp_path_factory.mktemp("served_cls"), num_labels=3,
                                   id2label={0: "neg", 1: "neutral", 2: "pos"},
                                   label2id={"neg": 0, "neutral": 1, "pos": 2})
    srv = RemoteServer([str(path), "--dtype", "float32", "--served-model-name", NAME,
                        "--log-stats-interval", "0"])
    yield srv, path
    srv.stop()


def test_classify_matches_offline(classifier):
    from pagedllm import LLM

    srv, path = classifier
    llm = LLM(str(path), dtype="float32")
    want = [o.outputs.probs for o in llm.classify(DOCS, use_tqdm=False)]
    llm.shutdown()
    for route in ("/classify", "/v1/classify"):
        r = _post(srv, route, {"input": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        for d, probs in zip(body["data"], want):
            assert d["probs"] == pytest.approx(probs, abs=1e-6) and d["num_classes"] == 3
            assert d["label"] == ["neg", "neutral", "pos"][max(range(3), key=probs.__getitem__)]
    one = _post(srv, "/classify", {"input": DOCS[0]}).json()
    assert one["data"][0]["probs"] == pytest.approx(want[0], abs=1e-6)
    # vLLM's /pooling: the model's own task (classification here), as LLM.encode.
    pooled = _post(srv, "/pooling", {"input": DOCS})
    assert pooled.status_code == 200, pooled.text
    body = pooled.json()
    assert body["object"] == "list" and body["id"].startswith("pool-")
    assert [d["object"] for d in body["data"]] == ["pooling"] * 4
    for d, probs in zip(body["data"], want):
        assert d["data"] == pytest.approx(probs, abs=1e-6)
    r = _post(srv, "/pooling", {"input": "x", "task": "embed"})
    assert r.status_code == 400 and "is not this model's" in r.json()["error"]["message"]
    # vLLM's use_activation: false gives the head's logits, whose softmax is the probs.
    for route in ("/classify", "/pooling"):
        r = _post(srv, route, {"input": DOCS, "use_activation": False})
        assert r.status_code == 200, r.text
        for d, probs in zip(r.json()["data"], want):
            logits = torch.tensor(d["probs" if route == "/classify" else "data"])
            assert torch.softmax(logits, dim=-1).tolist() == pytest.approx(probs, abs=1e-6)
    for body, fragment in (({"input": "x", "normalize": True}, "normalize applies"),
                           ({"input": "x", "dimensions": 2}, "dimensions applies")):
        r = _post(srv, "/pooling", body)
        assert r.status_code == 400 and fragment in r.text, r.text
    for body, fragment in (({"input": []}, "input must not be empty"),
                           ({"input": 5}, "input")):
        r = _post(srv, "/classify", body)
        assert r.status_code == 400 and fragment in r.text, r.text
    r = _post(srv, "/v1/score", {"text_1": "a", "text_2": "b"})
    assert r.status_code == 400 and "is a classifier" in r.json()["error"]["message"]
