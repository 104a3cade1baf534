"""vLLM's Tokens In<>Out API, POST /inference/v1/generate (serving_generate.py), and the
servers without a tokenizer (--tokens-only, --skip-tokenizer-init).

The reference for every output is /v1/completions on the same token-id prompt: the same
engine, so the same tokens, text and logprobs, whatever the shape they come in.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.entrypoints.utils import MODEL_NAME, RemoteServer

SERVER_ARGS = ["--max-model-len", "512", "--num-kv-blocks", "256", "--max-num-seqs", "8",
               "--enable-prompt-tokens-details"]
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28,
          7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198]
GENERATE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS)
    yield srv
    srv.stop()


def _post(server: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _completion(server: RemoteServer, **fields) -> dict:
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _stream(server: RemoteServer, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + GENERATE, json=dict(body, stream=True),
                      timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _detokenize(server: RemoteServer, ids: list[int]) -> str:
    return _post(server, "/detokenize", {"tokens": ids}).json()["prompt"]


def test_token_ids_and_logprobs_are_the_completions(server):
    r = _post(server, GENERATE, {"token_ids": PROMPT, "sampling_params": {
        "temperature": 0, "max_tokens": 12, "logprobs": 3, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"].startswith("generate-tokens-")
    assert body["output_mode"] == "tokens" and body["model"] == MODEL_NAME
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        len(PROMPT), 12, len(PROMPT) + 12)
    [choice] = body["choices"]
    assert "text" not in choice and choice["finish_reason"] == "length"
    ref = _completion(server, max_tokens=12, logprobs=3, ignore_eos=True)
    assert _detokenize(server, choice["token_ids"]) == ref["text"]
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == choice["token_ids"]
    assert [e["logprob"] for e in content] == ref["logprobs"]["token_logprobs"]
    for entry, ref_top in zip(content, ref["logprobs"]["top_logprobs"]):
        # The sampled token first, then the others by rank: 3 entries (vLLM's list).
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["token_id"] == entry["token_id"]
        assert [t["rank"] for t in top[1:]] == sorted(t["rank"] for t in top[1:])
        assert {t["logprob"] for t in top} <= set(ref_top.values())
        assert top[0]["rank"] == entry["rank"] >= 1


def test_text_mode_stop_strings_and_prompt_ids(server):
    ref = _completion(server, max_tokens=16, logprobs=2)
    r = _post(server, GENERATE, {"token_ids": PROMPT, "output_mode": "text",
                                 "return_token_ids": True, "sampling_params": {
                                     "temperature": 0, "max_tokens": 16, "logprobs": 2}})
    body = r.json()
    assert body["output_mode"] == "text" and body["prompt_token_ids"] == PROMPT
    [choice] = body["choices"]
    assert choice["text"] == ref["text"]
    assert [e["token"] for e in choice["logprobs"]["content"]] == ref["logprobs"]["tokens"]
    # A stop string ends it where completions' does, the tokens kept whole.
    stop = ref["text"][len(ref["text"]) // 2:][:3]
    ref = _completion(server, max_tokens=16, stop=[stop])
    r = _post(server, GENERATE, {"token_ids": PROMPT, "output_mode": "text",
                                 "sampling_params": {"temperature": 0, "max_tokens": 16,
                                                     "stop": [stop]}})
    [choice] = r.json()["choices"]
    assert choice["text"] == ref["text"] and choice["stop_reason"] == stop
    assert choice["finish_reason"] == "stop"


def test_a_stream_carries_what_the_response_does(server):
    sampling = {"temperature": 0.8, "seed": 7, "n": 2, "max_tokens": 10, "logprobs": 1,
                "ignore_eos": True}
    full = _post(server, GENERATE, {"token_ids": PROMPT, "sampling_params": sampling}).json()
    chunks = _stream(server, {"token_ids": PROMPT, "sampling_params": sampling,
                              "return_token_ids": True,
                              "stream_options": {"include_usage": True}})
    assert chunks[0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    *token_chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 20
    for choice in full["choices"]:
        parts = [c["choices"][0] for c in token_chunks
                 if c["choices"][0]["index"] == choice["index"]]
        assert sum((p["token_ids"] for p in parts), []) == choice["token_ids"]
        assert sum((p["logprobs"]["content"] for p in parts), []) == \
            choice["logprobs"]["content"]
        assert [p["finish_reason"] for p in parts][-1] == "length"
        assert all(p["finish_reason"] is None for p in parts[:-1])
    # Text mode: the text in pieces.
    chunks = _stream(server, {"token_ids": PROMPT, "output_mode": "text",
                              "sampling_params": {"temperature": 0, "max_tokens": 10}})
    assert "".join(c["choices"][0]["text"] for c in chunks) == \
        _completion(server, max_tokens=10)["text"]


@pytest.mark.parametrize("body,message", [
    ({"token_ids": [], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [-1], "sampling_params": {}}, "negative"),
    ({"token_ids": [10 ** 9], "sampling_params": {}}, "out of vocabulary"),
    ({"token_ids": [1]}, "sampling_params"),
    ({"token_ids": [1], "sampling_params": {"best_of_n": 2}}, "sampling_params.best_of_n"),
    ({"token_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"token_ids": [1], "sampling_params": {"n": 1000}}, "--max-n"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 10 ** 6}}, "context length"),
    ({"token_ids": [1], "sampling_params": {"logprobs": 1000}}, "logprobs"),
    ({"token_ids": [1], "sampling_params": {"top_p": 2}}, "top_p"),
    ({"token_ids": [1], "sampling_params": {"detokenize": False}, "output_mode": "text"},
     "detokenize"),
    ({"token_ids": [1], "sampling_params": {}, "output_mode": "words"}, "output_mode"),
    ({"token_ids": [1], "sampling_params": {}, "cache_salt": ""}, "cache_salt"),
    ({"token_ids": [1], "sampling_params": {}, "cache_salt": "s" * 129}, "cache_salt"),
    ({"token_ids": [1], "sampling_params": {}, "kv_transfer_params": {"a": 1}},
     "kv_transfer_params"),
    ({"token_ids": [1], "sampling_params": {}, "stream_options": {"include_usage": True}},
     "stream_options"),
    ({"token_ids": [1], "sampling_params": {}, "model": "other"}, "other"),
])
def test_bad_requests_get_a_4xx_naming_what_is_wrong(server, body, message):
    r = _post(server, GENERATE, body)
    assert 400 <= r.status_code < 500, r.text
    assert message in r.json()["error"]["message"]


def test_cache_salt_keeps_prefixes_apart_on_every_route(server):
    prompt = list(range(1000, 1000 + 70))  # 4 full blocks of 16 and 6 tokens

    def cached(path: str, salt: str | None) -> int:
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1}}
        if path == "/v1/completions":
            body = {"prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        r = _post(server, path, body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(GENERATE, "s1") == 0
    assert cached(GENERATE, "s1") == 64
    assert cached("/v1/completions", "s1") == 64
    assert cached("/v1/completions", "s2") == 0
    assert cached(GENERATE, "s2") == 64
    assert cached(GENERATE, None) == 0
    r = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 1,
        "cache_salt": "s3"})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 1,
        "cache_salt": "s3"})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    r = _post(server, "/v1/completions", {"prompt": prompt, "cache_salt": "/" * 200})
    assert r.status_code == 400 and "cache_salt" in r.text


def test_abort_requests_ends_a_running_request_by_its_id(server):
    outcome = {}

    def run():
        outcome["chunks"] = _stream(server, {
            "token_ids": PROMPT, "request_id": "abort-me",
            "sampling_params": {"max_tokens": 400, "ignore_eos": True}})

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(1.0)
    r = _post(server, "/inference/v1/abort_requests", {"request_ids": ["abort-me"]})
    assert r.status_code == 200
    thread.join(60)
    chunks = outcome["chunks"]
    assert chunks[0]["request_id"] == "generate-tokens-abort-me"
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) < 400
    assert httpx.get(server.url + "/debug/stats", timeout=10).json()["num_running"] == 0
    # Unknown ids are no error; the body is checked.
    assert _post(server, "/inference/v1/abort_requests",
                 {"request_ids": ["nobody"]}).status_code == 200
    assert _post(server, "/inference/v1/abort_requests", {"ids": []}).status_code == 400


def test_a_tokens_only_server_serves_tokens_and_nothing_that_needs_text(server):
    srv = RemoteServer([*SERVER_ARGS, "--tokens-only"])
    try:
        sampling = {"temperature": 0, "max_tokens": 8, "logprobs": 2}
        r = _post(srv, GENERATE, {"token_ids": PROMPT, "sampling_params": sampling})
        ref = _post(server, GENERATE, {"token_ids": PROMPT, "sampling_params": sampling})
        assert r.json()["choices"] == ref.json()["choices"]
        assert _post(srv, "/v1/completions", {"prompt": "hi"}).status_code == 404
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == MODEL_NAME
        assert _post(srv, "/abort_requests", {"request_ids": ["x"]}).status_code == 200
        for field, value in (("stop", ["x"]), ("bad_words", ["x"]),
                             ("structured_outputs", {"regex": "a+"})):
            r = _post(srv, GENERATE, {"token_ids": PROMPT,
                                      "sampling_params": {field: value}})
            assert r.status_code == 400 and "needs a tokenizer" in r.text
        r = _post(srv, GENERATE, {"token_ids": PROMPT, "sampling_params": {},
                                  "output_mode": "text"})
        assert r.status_code == 400 and "--tokens-only" in r.text
    finally:
        srv.stop()


def test_a_server_without_a_tokenizer_refuses_text_routes_by_name():
    srv = RemoteServer([*SERVER_ARGS, "--skip-tokenizer-init"])
    try:
        r = _post(srv, GENERATE, {"token_ids": PROMPT, "sampling_params": {
            "max_tokens": 4, "stop_token_ids": [2]}})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) <= 4
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            r = _post(srv, path, {"prompt": PROMPT})
            assert r.status_code == 400 and "--skip-tokenizer-init" in r.text
        assert httpx.get(srv.url + "/tokenizer_info").status_code == 400
    finally:
        srv.stop()


def test_completions_and_chat_return_token_ids_when_asked(server):
    """vLLM's return_token_ids: the generated ids (the same as /inference/v1/generate's),
    the prompt's ids; streams send each chunk's new ids, the prompt's once."""
    sampling = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
    ids = _post(server, GENERATE, {"token_ids": PROMPT, "sampling_params": sampling}
                ).json()["choices"][0]["token_ids"]
    body = {"prompt": PROMPT, "return_token_ids": True, **sampling}
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    assert choice["token_ids"] == ids and choice["prompt_token_ids"] == PROMPT
    assert "token_ids" not in _completion(server, max_tokens=2)  # only when asked
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json=body | {"stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    parts = [c["choices"][0] for c in chunks]
    assert parts[0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in p for p in parts[1:])
    assert sum((p["token_ids"] for p in parts), []) == ids

    messages = [{"role": "user", "content": "Name three colors."}]
    prompt_ids = _post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    body = {"messages": messages, "return_token_ids": True, **sampling}
    reply = _post(server, "/v1/chat/completions", body).json()
    assert reply["prompt_token_ids"] == prompt_ids
    expected = _post(server, GENERATE, {"token_ids": prompt_ids, "sampling_params": sampling}
                     ).json()["choices"][0]["token_ids"]
    assert reply["choices"][0]["token_ids"] == expected
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json=body | {"stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == expected


def test_render_gives_the_generate_body_that_runs_the_request(server):
    """vLLM's render routes: the /inference/v1/generate body of a chat, completion,
    Anthropic or Responses request runs it, token for token (structured outputs
    included)."""
    messages = [{"role": "user", "content": "Give a name and an age."}]
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    chat = {"messages": messages, "temperature": 0, "max_tokens": 24, "seed": 3,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": schema}}}
    body = _post(server, "/v1/chat/completions/render", chat).json()
    assert body["request_id"].startswith("chatcmpl-") and body["stream"] is False
    assert body["token_ids"] == _post(server, "/tokenize", {"messages": messages}
                                      ).json()["tokens"]
    params = body["sampling_params"]
    assert (params["max_tokens"], params["temperature"], params["seed"]) == (24, 0, 3)
    assert params["structured_outputs"]["json"] == schema
    out = _post(server, GENERATE, body | {"output_mode": "text"}).json()["choices"][0]
    ref = _post(server, "/v1/chat/completions", chat).json()["choices"][0]
    assert out["text"] == ref["message"]["content"]
    json.loads(out["text"])  # the constraint ran
    # max_tokens left out: what the context leaves, as the route would run it.
    free = _post(server, "/v1/chat/completions/render", {"messages": messages}).json()
    assert free["sampling_params"]["max_tokens"] == 512 - len(free["token_ids"])

    bodies = _post(server, "/v1/completions/render", {
        "prompt": ["The sky is", "Once upon"], "max_tokens": 5, "temperature": 0,
        "request_id": "r1", "stop": ["\n"]}).json()
    assert [b["request_id"] for b in bodies] == ["r1-0", "r1-1"]
    assert bodies[1]["token_ids"] == _post(server, "/tokenize", {"prompt": "Once upon"}
                                           ).json()["tokens"]
    assert bodies[0]["sampling_params"]["stop"] == ["\n"]
    for b, prompt in zip(bodies, ["The sky is", "Once upon"]):
        out = _post(server, GENERATE, b | {"output_mode": "text"}).json()["choices"][0]
        assert out["text"] == _completion(server, prompt=prompt, max_tokens=5,
                                          stop=["\n"])["text"]

    anthropic = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0,
                 "system": "Be brief.", "messages": messages}
    body = _post(server, "/v1/messages/render", anthropic).json()
    assert body["request_id"].startswith("msg_")
    out = _post(server, GENERATE, body | {"output_mode": "text"}).json()["choices"][0]
    reply = _post(server, "/v1/messages", anthropic).json()
    assert out["text"] == reply["content"][0]["text"]

    response = {"input": "Give a name and an age.", "instructions": "Be brief.",
                "max_output_tokens": 8, "temperature": 0, "store": False}
    body = _post(server, "/v1/responses/render", response).json()
    assert body["request_id"].startswith("resp_")
    assert body["sampling_params"]["max_tokens"] == 8
    out = _post(server, GENERATE, body | {"output_mode": "text"}).json()["choices"][0]
    reply = _post(server, "/v1/responses", response).json()
    assert out["text"] == reply["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("path, body, message", [
    ("/v1/chat/completions/render", {"messages": []}, "messages must not be empty"),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "x"}],
                                     "echo": True}, "echo"),
    ("/v1/completions/render", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions/render", {"prompt": "x", "max_tokens": 10 ** 6},
     "maximum context length"),
    ("/v1/messages/render", {"model": MODEL_NAME, "max_tokens": 0,
                             "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    # What the engine refuses when the request is added: refused here too.
    ("/v1/completions/render", {"prompt": "x", "priority": 1}, "Priority scheduling"),
    ("/v1/completions/render", {"prompt": "x", "stop_token_ids": [10 ** 8]},
     "out of vocabulary"),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "x"}],
                                     "cache_salt": ""}, "cache_salt"),
    ("/v1/completions/render", {"prompt": "x", "request_id": "r" * 300}, "request_id"),
    ("/v1/responses/render", {"input": "x", "max_output_tokens": 10 ** 6},
     "maximum context length"),
    ("/v1/responses/render", {"input": "x", "previous_response_id": "resp_none"},
     "--enable-responses-store"),
])
def test_render_refuses_what_its_route_would(server, path, body, message):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"]
    assert ("type" in r.json()) == path.startswith("/v1/messages")  # Anthropic's form
