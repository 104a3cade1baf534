"""POST /v1/embeddings against the bundled SmolLM2-135M-Instruct (served once for the
module, float32): the vectors match LLM.embed, both encodings, list and token-id inputs,
usage, and 400s for bad bodies."""

from __future__ import annotations


import httpx
import numpy as np
import pytest

from tests.entrypoints.utils import MODEL_NAME, RemoteServer, embedding_vectors

MAX_MODEL_LEN = 256
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               "--num-kv-blocks", "64", "--max-num-seqs", "16",
               "--log-stats-interval", "0"]
# Server and offline engine run the same float32 CPU kernels and each vector is pooled
# on its own: measured bit-identical (max abs diff 0.0); 1e-5 leaves room for kernels
# whose reductions depend on the batch.
TOL = 1e-5
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "Hello"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline():
    """LLM.embed's vectors and token ids of TEXTS, in float32 like the server."""
    from pagedllm import LLM

    llm = LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    outs = llm.embed(TEXTS, use_tqdm=False)
    result = ([np.array(o.outputs.embedding, dtype=np.float32) for o in outs],
              [o.prompt_token_ids for o in outs])
    llm.shutdown()
    return result


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json=body, timeout=120)


def test_float_and_base64_match_offline(server, offline):
    want, prompt_ids = offline
    for fmt in ("float", "base64"):
        r = _post(server, {"model": MODEL_NAME, "input": TEXTS, "encoding_format": fmt,
                           "user": "someone"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == MODEL_NAME
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert all(d["object"] == "embedding" for d in body["data"])
        got = embedding_vectors(body)
        for g, w in zip(got, want):
            assert g.shape == w.shape == (576,)
            np.testing.assert_allclose(g, w, atol=TOL, rtol=0)
            assert abs(np.linalg.norm(g) - 1.0) < 1e-5
        num_tokens = sum(len(ids) for ids in prompt_ids)
        assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}


def test_use_activation_and_normalize(server, offline):
    """vLLM 0.32's use_activation (and older vLLM's normalize): false gives the pooled
    state as it is, whose direction is the default embedding's."""
    want, _ = offline
    for body in ({"use_activation": False}, {"normalize": False},
                 {"normalize": False, "use_activation": False}):
        r = _post(server, {"input": TEXTS[0], **body})
        assert r.status_code == 200, r.text
        raw = embedding_vectors(r.json())[0]
        assert np.linalg.norm(raw) > 2
        np.testing.assert_allclose(raw / np.linalg.norm(raw), want[0], atol=TOL, rtol=0)
    r = _post(server, {"input": "hi", "normalize": True, "use_activation": False})
    assert r.status_code == 400 and "disagree" in r.json()["error"]["message"]


def test_single_string_and_token_ids(server, offline):
    want, prompt_ids = offline
    single = _post(server, {"input": TEXTS[1]}).json()
    assert len(single["data"]) == 1 and single["data"][0]["index"] == 0
    np.testing.assert_allclose(embedding_vectors(single)[0], want[1], atol=TOL, rtol=0)
    # One list of ids is one input; a list of lists is several, in order.
    one = _post(server, {"input": prompt_ids[0]}).json()
    np.testing.assert_allclose(embedding_vectors(one)[0], want[0], atol=TOL, rtol=0)
    assert one["usage"]["prompt_tokens"] == len(prompt_ids[0])
    many = _post(server, {"input": prompt_ids[::-1]}).json()
    assert [d["index"] for d in many["data"]] == [0, 1, 2]
    for g, w in zip(embedding_vectors(many), want[::-1]):
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0)


@pytest.mark.parametrize("body,field", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["ok", ""]}, "input[1]"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": "hi", "dimensions": 32}, "dimensions"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": 5}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": {"text": "hi"}}, "input"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": [1] * (MAX_MODEL_LEN + 1)}, "maximum context length"),
    ({"input": [[1, 2], [1] * (MAX_MODEL_LEN + 1)]}, "input[1]"),
    ({"input": ["fine", [1, 2]]}, "input"),
    ({"input": [[1, 2], [10 ** 9]]}, "vocabulary"),
    ({"model": "other-model", "input": "hi"}, "other-model"),
])
def test_bad_requests(server, body, field):
    r = _post(server, body)
    expected = 404 if "model" in body else 400
    assert r.status_code == expected, r.text
    assert field in r.json()["error"]["message"] or r.json()["error"]["param"] == field


def test_rejected_input_leaves_nothing_running(server):
    # The first input is valid and submitted before the second is rejected: the call
    # fails as a whole and the first request is aborted, not left in the engine.
    r = _post(server, {"input": ["a valid sentence", [10 ** 9]]})
    assert r.status_code == 400
    stats = server.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert _post(server, {"input": "still serving"}).status_code == 200


def test_metrics_count_prompt_tokens(server):
    def prompt_tokens() -> float:
        text = httpx.get(server.url + "/metrics").text
        lines = [l for l in text.splitlines()
                 if l.startswith("pagedllm:prompt_tokens_total")]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    before = prompt_tokens()
    r = _post(server, {"input": [[5, 6, 7, 8]]})
    assert r.status_code == 200
    assert prompt_tokens() - before == 4


def test_truncate_prompt_tokens_embeds_the_inputs_last_tokens(server, offline):
    want, prompt_ids = offline
    ids = prompt_ids[1]
    by_text = _post(server, {"input": TEXTS[1], "truncate_prompt_tokens": 3})
    assert by_text.status_code == 200, by_text.text
    assert by_text.json()["usage"]["prompt_tokens"] == 3
    last = _post(server, {"input": ids[-3:]}).json()
    cut = embedding_vectors(by_text.json())[0]
    np.testing.assert_allclose(cut, embedding_vectors(last)[0], atol=TOL, rtol=0)
    assert np.abs(cut - want[1]).max() > 1e-3  # not the whole input's vector
