"""vLLM's POST /generative_scoring and `logprob_token_ids` on chat and
/inference/v1/generate, on the bundled model. The reference for a label's logprob is the
same step's top-k logprobs (the native scoring path; the labels take torch's
log-softmax), with labels chosen among the top 5."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.entrypoints.utils import RemoteServer

QUERY = "Question: is the sky blue on a clear day? Answer yes or no.\nAnswer:"


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(["--max-model-len", "256", "--num-kv-blocks", "128",
                        "--max-num-seqs", "8"])
    yield srv
    srv.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _ids(server, text: str, special: bool) -> list[int]:
    r = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": special})
    return r.json()["tokens"]


def _top5(server, ids: list[int]) -> dict[int, float]:
    """The next token's 5 most likely ids and their logprobs (the top-k path)."""
    r = _post(server, "/inference/v1/generate", {
        "token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0,
                                              "logprobs": 5}})
    return {e["token_id"]: e["logprob"]
            for e in r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}


def test_scores_are_the_label_probabilities(server):
    query = _ids(server, QUERY, True)
    items = [_ids(server, " I think", False), _ids(server, " Well,", False)]
    labels, expected = None, []
    for item in items:
        top = _top5(server, query + item)
        labels = labels or list(top)[1:3]  # two likely tokens, not always the argmax
        lps = [top.get(t) for t in labels]
        assert None not in lps, "the labels are among both prompts' top 5"
        expected.append(lps)
    body = {"query": query, "items": items, "label_token_ids": labels}
    r = _post(server, "/generative_scoring", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [d["index"] for d in out["data"]] == [0, 1]
    for d, (a, b) in zip(out["data"], expected):
        assert d["score"] == pytest.approx(1 / (1 + math.exp(b - a)), rel=1e-4)
    assert out["usage"]["prompt_tokens"] == sum(len(query) + len(i) for i in items)
    assert out["usage"]["completion_tokens"] == 2
    whole = _post(server, "/generative_scoring", body | {"apply_softmax": False}).json()
    for d, (a, _) in zip(whole["data"], expected):
        assert d["score"] == pytest.approx(math.exp(a), rel=1e-4)
    # Text in, tokenized as given: the query with its special tokens, items without.
    text = _post(server, "/generative_scoring", {
        "query": QUERY, "items": [" I think", " Well,"], "label_token_ids": labels}).json()
    assert [d["score"] for d in text["data"]] == [d["score"] for d in out["data"]]
    # item_first puts the item before the query.
    first = _post(server, "/generative_scoring", {
        "query": items[0], "items": [query], "label_token_ids": labels,
        "item_first": True}).json()
    assert first["data"][0]["score"] == out["data"][0]["score"]


def test_chat_and_generate_list_the_labels(server):
    messages = [{"role": "user", "content": "Is the sky blue? Reply yes or no."}]
    base = {"messages": messages, "max_tokens": 3, "temperature": 0, "logprobs": True}
    top = _post(server, "/v1/chat/completions", base | {"top_logprobs": 5}).json()
    steps = top["choices"][0]["logprobs"]["content"]
    names = [e["token"] for e in steps[0]["top_logprobs"]][3:0:-1]  # ranks 4, 3, 2
    labels = [_ids(server, n, False)[0] for n in names]
    r = _post(server, "/v1/chat/completions", base | {"logprob_token_ids": labels})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]["content"]
    assert [s["token"] for s in got] == [s["token"] for s in steps]  # the same reply
    assert [e["token"] for e in got[0]["top_logprobs"]] == names  # the labels, in order
    ref = {e["token"]: e["logprob"] for e in steps[0]["top_logprobs"]}
    for e in got[0]["top_logprobs"]:
        assert e["logprob"] == pytest.approx(ref[e["token"]], abs=1e-4)
    # Streamed: the same lists.
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json=base | {"logprob_token_ids": labels, "stream": True}) as s:
        chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [e["token"] for c in chunks for ch in json.loads(c[6:])["choices"]
                if ch.get("logprobs") for t in ch["logprobs"]["content"]
                for e in t["top_logprobs"]]
    assert streamed[:3] == names
    # The Tokens In<>Out API: the sampled token first, then the labels.
    ids = _ids(server, QUERY, True)
    r = _post(server, "/inference/v1/generate", {
        "token_ids": ids, "sampling_params": {"max_tokens": 2, "temperature": 0,
                                              "logprob_token_ids": labels}})
    for step in r.json()["choices"][0]["logprobs"]["content"]:
        assert [e["token_id"] for e in step["top_logprobs"]][1:] == labels


def test_what_it_refuses(server):
    good = {"query": "Is it?", "items": [" yes"], "label_token_ids": [10, 11]}
    for fields, named in (({"label_token_ids": [49152]}, "vocabulary"),
                          ({"label_token_ids": []}, "label_token_ids"),
                          ({"label_token_ids": list(range(129))}, "label_token_ids"),
                          ({"label_token_ids": [1, 1]}, "repeat"),
                          ({"items": []}, "items"),
                          ({"items": [" x" * 300]}, "max_model_len"),
                          ({"items": [[1], "a"]}, "items"),
                          ({"query": [1.5]}, "query"),
                          ({"temperature": 0}, "temperature")):
        r = _post(server, "/generative_scoring", good | fields)
        assert r.status_code == 400 and named in r.text, (fields, r.text)
    r = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "logprob_token_ids": [1]})
    assert r.status_code == 400 and "logprobs: true" in r.text
    assert _post(server, "/generative_scoring", good).status_code == 200
