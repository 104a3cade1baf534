"""POST /v1/embeddings against a tiny random BertModel served live (float32): vectors
equal LLM.embed's in both encodings, token-id inputs, and the encoder's 400s (no
completions or chat, inputs past the learned positions)."""

from __future__ import annotations


import httpx
import numpy as np
import pytest

from tests.entrypoints.utils import RemoteServer, embedding_vectors
from tests.utils import save_tiny_bert

NAME = "tiny-bert"
MAX_POSITIONS = 64
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France!", "Hello",
         "the dog is playing guitar, the man sat on a mat"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("served_bert"),
                          max_position_embeddings=MAX_POSITIONS)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = RemoteServer([str(model_dir), "--dtype", "float32", "--served-model-name", NAME,
                        "--log-stats-interval", "0"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    """LLM.embed's vectors and token ids of TEXTS (mean pooling, BERT's default)."""
    from pagedllm import LLM

    llm = LLM(str(model_dir), dtype="float32")
    outs = llm.embed(TEXTS, use_tqdm=False)
    llm.shutdown()
    return ([np.array(o.outputs.embedding, dtype=np.float32) for o in outs],
            [o.prompt_token_ids for o in outs])


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=120)


def test_float_and_base64_match_offline(server, offline):
    want, prompt_ids = offline
    for fmt in ("float", "base64"):
        r = _post(server, "/v1/embeddings",
                  {"model": NAME, "input": TEXTS, "encoding_format": fmt})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == NAME and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        for got, w in zip(embedding_vectors(body), want, strict=True):
            assert got.shape == w.shape == (64,)
            # Same float32 kernels, each request attending to its own tokens only.
            np.testing.assert_allclose(got, w, atol=1e-6, rtol=0)
            assert abs(np.linalg.norm(got) - 1.0) < 1e-5
        num_tokens = sum(len(ids) for ids in prompt_ids)  # [CLS] and [SEP] included
        assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}


def test_token_id_inputs(server, offline):
    want, prompt_ids = offline
    r = _post(server, "/v1/embeddings", {"model": NAME, "input": prompt_ids[:2]})
    assert r.status_code == 200, r.text
    for got, w in zip(embedding_vectors(r.json()), want[:2], strict=True):
        np.testing.assert_allclose(got, w, atol=1e-6, rtol=0)


def test_generation_routes_answer_400(server):
    r = _post(server, "/v1/completions", {"model": NAME, "prompt": "The cat", "max_tokens": 4})
    assert r.status_code == 400 and "does not support generation" in r.text, r.text
    r = _post(server, "/v1/chat/completions",
              {"model": NAME, "messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 400 and "does not support generation" in r.text, r.text
    assert r.json()["error"]["type"] == "BadRequestError"


def test_input_past_the_positions_is_400(server):
    r = _post(server, "/v1/embeddings", {"model": NAME, "input": ["cat " * MAX_POSITIONS]})
    assert r.status_code == 400, r.text
    assert f"maximum context length is {MAX_POSITIONS}" in r.text
    # Still serving.
    assert _post(server, "/v1/embeddings", {"model": NAME, "input": "Hello"}).status_code == 200


def test_score_and_rerank_by_cosine(server, model_dir):
    """An embedding model scores pairs by the cosine similarity of their embeddings
    (LLM.score's numbers); /rerank orders the documents by it."""
    from pagedllm import LLM

    query, docs = TEXTS[0], TEXTS[1:]
    r = _post(server, "/v1/score", {"model": NAME, "text_1": query, "text_2": docs})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
    scores = [d["score"] for d in body["data"]]
    assert body["usage"]["prompt_tokens"] > 0
    llm = LLM(str(model_dir), dtype="float32")
    want = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    llm.shutdown()
    assert scores == pytest.approx(want, abs=1e-6)
    same = _post(server, "/score", {"queries": [query] * 3, "documents": docs}).json()
    assert [d["score"] for d in same["data"]] == pytest.approx(scores, abs=1e-6)
    ranked = _post(server, "/v1/rerank", {"query": query, "documents": docs, "top_n": 2})
    assert ranked.status_code == 200, ranked.text
    results = ranked.json()["results"]
    order = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [x["index"] for x in results] == order
    assert [x["document"]["text"] for x in results] == [docs[i] for i in order]
    assert [x["relevance_score"] for x in results] == pytest.approx(
        [scores[i] for i in order], abs=1e-6)


@pytest.mark.parametrize("body,fragment", [
    ({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "give one text_1"),
    ({"text_1": "a"}, "text_1 and text_2 are both required"),
    ({"text_1": "a", "text_2": "b", "queries": "c", "documents": "d"}, "give text_1 and"),
    ({"text_1": "a", "text_2": []}, "text_2 must not be empty"),
    ({"text_1": 1, "text_2": "b"}, "text_1"),
])
def test_score_400s(server, body, fragment):
    r = _post(server, "/v1/score", body)
    assert r.status_code == 400 and fragment in r.text, r.text


def test_rerank_400s(server):
    for body, fragment in (({"query": "a", "documents": []}, "documents must not be empty"),
                           ({"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
                           ({"documents": ["b"]}, "query")):
        r = _post(server, "/v2/rerank", body)
        assert r.status_code == 400 and fragment in r.text, r.text
