"""The OpenAI-compatible server with the real `openai` client, against the bundled
SmolLM2-135M-Instruct (a chat template, a real tokenizer) served once for the module."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.entrypoints.utils import MODEL_NAME, HealthProbe, RemoteServer

API_KEY = "test-key"
MAX_MODEL_LEN = 1024
# Dequantized float32: the answers some tests check (test_chat's "Paris") sit near ties
# that bfloat16 or the native quantized GEMM's int8 activations tip the other way.
SERVER_ARGS = ["--dtype", "float32", "--quantization", "none",
               "--max-model-len", str(MAX_MODEL_LEN),
               "--num-kv-blocks", "192", "--max-num-seqs", "32",
               "--log-stats-interval", "2"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS, api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def num_tokens(server: RemoteServer, text: str) -> int:
    r = httpx.post(server.url + "/tokenize", headers=server.headers, json={"prompt": text})
    return r.json()["count"]


# ------------------------------------------------------------------ basics

def test_models_version_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).model_dump() == models.data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="org/nope"):
        client.models.retrieve("org/nope")
    assert httpx.get(server.url + "/version", headers=server.headers).json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_tokenize_detokenize(server):
    r = httpx.post(server.url + "/tokenize", headers=server.headers,
                   json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(server.url + "/detokenize", headers=server.headers,
                      json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    chat = httpx.post(server.url + "/tokenize", headers=server.headers,
                      json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    text = httpx.post(server.url + "/detokenize", headers=server.headers,
                      json={"tokens": chat["tokens"]}).json()
    assert "<|im_start|>user\nHi<|im_end|>" in text["prompt"]


def test_tokenize_takes_the_chat_fields(server):
    """continue_final_message, chat_template_kwargs and return_token_strs as on a chat
    request (vLLM's /tokenize); a conversation a chat request would refuse is a 400."""
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.url + path, headers=server.headers, json=body)

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    r = post("/tokenize", {"messages": messages, "continue_final_message": True,
                           "add_generation_prompt": False, "return_token_strs": True,
                           "chat_template_kwargs": {"unused": 1}}).json()
    text = post("/detokenize", {"tokens": r["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nHello")  # left open, to be continued
    assert len(r["token_strs"]) == r["count"] and r["token_strs"][-1] == "Hello"
    assert post("/tokenize", {"prompt": "Hi"}).json()["token_strs"] is None
    unanswered = [{"role": "user", "content": "Hi"},
                  {"role": "tool", "tool_call_id": "nope", "content": "r"}]
    r = post("/tokenize", {"messages": unanswered})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------ completions

def test_completion_usage_and_logprobs(server, client):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5,
                                  temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == num_tokens(server, prompt)
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == choice.text
    assert all(v <= 0 for v in lp.token_logprobs)
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert token in top and 1 <= len(top) <= 3
    # Greedy: the chosen token is the most likely one.
    assert all(top[t] == max(top.values()) for t, top in zip(lp.tokens, lp.top_logprobs))


def test_completion_prompt_forms_n_and_echo(server, client):
    ids = httpx.post(server.url + "/tokenize", headers=server.headers,
                     json={"prompt": "One, two,"}).json()["tokens"]
    r = client.completions.create(model=MODEL_NAME, prompt=["Hello", "One, two,"],
                                  max_tokens=3, n=2, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == num_tokens(server, "Hello") + len(ids)
    # Token-id prompts (one list, a list of lists) give the same greedy text as the
    # string; echo puts the prompt text in front.
    echo = client.completions.create(model=MODEL_NAME, prompt="One, two,", max_tokens=3,
                                     temperature=0, echo=True)
    text = echo.choices[0].text
    assert text.startswith("One, two,") and len(text) > len("One, two,")
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=3,
                                       temperature=0)
    two = client.completions.create(model=MODEL_NAME, prompt=[ids, ids], max_tokens=3,
                                    temperature=0)
    expected = text[len("One, two,"):]
    assert [c.text for c in by_ids.choices + two.choices] == [expected] * 3


def test_echo_with_max_tokens_zero_scores_the_prompt(server, client):
    """Prompt scoring as harnesses do it: echo, max_tokens 0, logprobs -> the prompt's
    own tokens and logprobs, nothing generated; streamed the same."""
    prompt = "The capital of France is Paris"
    ids = httpx.post(server.url + "/tokenize", headers=server.headers,
                     json={"prompt": prompt}).json()["tokens"]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    # The same numbers as the prompt logprobs of a request that does generate.
    longer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                       echo=True, logprobs=1, temperature=0)
    assert longer.choices[0].logprobs.token_logprobs[:len(ids)] == lp.token_logprobs
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0,
                                            echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0)


def test_prompt_logprobs_in_completion_and_chat(server, client):
    """vLLM's prompt_logprobs: per prompt token (None first) the token itself and the
    top-k by id, with ranks and text; the same numbers as echo's logprobs."""
    prompt = "The capital of France is Paris"
    ids = httpx.post(server.url + "/tokenize", headers=server.headers,
                     json={"prompt": prompt}).json()["tokens"]
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2,
                         "temperature": 0, "n": 2, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    field = choices[0]["prompt_logprobs"]
    assert choices[1]["prompt_logprobs"] == field  # one prompt, its n choices
    assert len(field) == len(ids) and field[0] is None
    echo = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                     echo=True, logprobs=3, temperature=0)
    echo_lp = echo.choices[0].logprobs
    for i in range(1, len(ids)):
        entry = field[i]
        assert 3 <= len(entry) <= 4 and str(ids[i]) in entry
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(echo_lp.token_logprobs[i], abs=1e-6)
        assert own["decoded_token"] == echo_lp.tokens[i] and own["rank"] >= 1
        assert sorted(e["rank"] for e in entry.values())[:3] == [1, 2, 3]
    # Not asked: not there.
    plain = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                       json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
    assert plain.json()["choices"][0].get("prompt_logprobs") is None
    chat = httpx.post(server.url + "/v1/chat/completions", headers=server.headers,
                      timeout=60, json={"model": MODEL_NAME, "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "Hi"}],
                                        "prompt_logprobs": 1})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert body["prompt_logprobs"][0] is None
    assert all(1 <= len(e) <= 2 for e in body["prompt_logprobs"][1:])
    # A long prompt's field is built and encoded in a worker thread (json_response).
    long_prompt = " ".join(f"word{i}" for i in range(200))
    num_long = num_tokens(server, long_prompt)
    for path, payload in (("/v1/completions", {"prompt": long_prompt}),
                          ("/v1/chat/completions",
                           {"messages": [{"role": "user", "content": long_prompt}]})):
        big = httpx.post(server.url + path, headers=server.headers, timeout=60,
                         json={"model": MODEL_NAME, "max_tokens": 1, "prompt_logprobs": 5}
                         | payload)
        assert big.status_code == 200, big.text
        assert big.headers["content-type"] == "application/json"
        data = big.json()
        field = data["prompt_logprobs"] if "messages" in payload else \
            data["choices"][0]["prompt_logprobs"]
        assert len(field) == data["usage"]["prompt_tokens"] >= num_long
        assert field[0] is None and all(5 <= len(e) <= 6 for e in field[1:])
    for path, payload in (("/v1/completions", {"prompt": prompt}),
                          ("/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "Hi"}]})):
        streamed = httpx.post(server.url + path, headers=server.headers, timeout=60,
                              json={"model": MODEL_NAME, "max_tokens": 2, "stream": True,
                                    "prompt_logprobs": 1} | payload)
        assert streamed.status_code == 400 and "prompt_logprobs" in streamed.text


def test_tokenizer_info(server):
    info = httpx.get(server.url + "/tokenizer_info", headers=server.headers).json()
    assert info["model_max_length"] == MAX_MODEL_LEN and info["vocab_size"] >= 49152
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    assert isinstance(info["tokenizer_class"], str)


def test_completion_n_with_one_token(client):
    """n > 1 whose first sample finishes in its first step: the held-back siblings
    must still reach the (then idle) engine."""
    r = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1, n=3,
                                  temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert len(r.choices) == 3 and r.usage.completion_tokens == 3


def test_completion_best_of(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, n=2,
                                  best_of=3, temperature=1.0, seed=1,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 2


def test_completion_stream_matches_full(server, client):
    kw = dict(model=MODEL_NAME, prompt="Here is a list of fruits:", max_tokens=12,
              temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # incremental


def test_completion_stream_raw_sse(server):
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers=server.headers) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert json.loads(line[6:])["object"] == "text_completion"


def test_completion_stop(client):
    r = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=20,
                                  temperature=0, stop=[" 7"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == " 7" or r.choices[0].model_extra["stop_reason"] == " 7"
    assert r.choices[0].text.strip().startswith("5") and " 7" not in r.choices[0].text


# ------------------------------------------------------------------ chat

def test_chat(server, client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16,
                                       temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    tokenized = httpx.post(server.url + "/tokenize", headers=server.headers,
                           json={"messages": messages}).json()
    assert r.usage.prompt_tokens == tokenized["count"]
    assert r.usage.completion_tokens <= 16
    # max_completion_tokens is honoured too.
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                        max_completion_tokens=2, temperature=0)
    assert r2.usage.completion_tokens == 2 and r2.choices[0].finish_reason == "length"


def test_chat_echo_prepends_the_continued_assistant_message(client):
    # vLLM's chat `echo`: the reply repeats the assistant message it continues.
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    kw = dict(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    plain = client.chat.completions.create(
        **kw, extra_body={"continue_final_message": True, "add_generation_prompt": False})
    echoed = client.chat.completions.create(
        **kw, extra_body={"continue_final_message": True, "add_generation_prompt": False,
                          "echo": True})
    continuation = plain.choices[0].message.content
    assert echoed.choices[0].message.content == "The capital of France is" + continuation
    stream = client.chat.completions.create(
        **kw, stream=True, extra_body={"continue_final_message": True,
                                       "add_generation_prompt": False, "echo": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == echoed.choices[0].message.content
    # The last message is the user's: nothing to echo.
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages[:1], max_tokens=4,
                                       temperature=0, extra_body={"echo": True})
    assert not r.choices[0].message.content.startswith("What is")


def test_chat_stream_n2_logprobs(client):
    messages = [{"role": "user", "content": "Say hello."}]
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0.8, seed=3, n=2,
        logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    texts, roles, finish, num_logprobs = ["", ""], set(), {}, [0, 0]
    usage = None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        choice = chunk.choices[0]
        roles.add(choice.delta.role)
        texts[choice.index] += choice.delta.content or ""
        if choice.logprobs and choice.logprobs.content:
            num_logprobs[choice.index] += len(choice.logprobs.content)
            for tok in choice.logprobs.content:
                assert len(tok.top_logprobs) == 2 and tok.logprob <= 0
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert "assistant" in roles
    assert finish == {0: "length", 1: "length"} and num_logprobs == [6, 6]
    assert all(texts) and usage.completion_tokens == 12


def test_chat_logprobs_full(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for tok in content:
        assert len(tok.top_logprobs) == 3 and tok.top_logprobs[0].token == tok.token
        assert tok.bytes == list(tok.token.encode())


def test_large_logprobs_responses_equal_their_streams(server, client):
    """Non-streaming responses whose logprobs are large (here 2 x 40 tokens x 21 entries,
    ~130 KB) are built a choice at a time in a worker thread and sent as they are built:
    the body is the same JSON as the streamed deltas add up to (greedy, seeded)."""
    common = dict(model=MODEL_NAME, max_tokens=40, temperature=0.7, seed=11, n=2,
                  extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    full = client.chat.completions.create(messages=messages, logprobs=True,
                                          top_logprobs=20, **common)
    streamed: dict[int, list] = {0: [], 1: []}
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(messages=messages, logprobs=True,
                                                top_logprobs=20, stream=True, **common):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                streamed[choice.index] += choice.logprobs.content
    assert sorted(c.index for c in full.choices) == [0, 1]
    for choice in full.choices:
        assert choice.message.content == texts[choice.index]
        assert [t.model_dump() for t in choice.logprobs.content] == [
            t.model_dump() for t in streamed[choice.index]]
        assert all(len(t.top_logprobs) == 20 for t in choice.logprobs.content)
    assert full.usage.completion_tokens == 80

    prompt = "The sea is"
    body = dict(common.pop("extra_body"), prompt=prompt, logprobs=20, echo=True, **common)
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                   timeout=120)
    assert r.status_code == 200 and "content-length" not in r.headers  # sent as built
    lines = httpx.post(server.url + "/v1/completions", json=body | {"stream": True},
                       headers=server.headers, timeout=120).text.split("\n\n")
    pieces: dict[int, dict] = {}
    for line in lines:
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[len("data: "):])["choices"]:
            got = pieces.setdefault(choice["index"], {"text": "", "tokens": [],
                                                      "top_logprobs": []})
            got["text"] += choice["text"]
            got["tokens"] += choice["logprobs"]["tokens"]
            got["top_logprobs"] += choice["logprobs"]["top_logprobs"]
    for choice in r.json()["choices"]:
        got = pieces[choice["index"]]
        assert choice["text"] == got["text"] and choice["text"].startswith(prompt)
        assert choice["logprobs"]["tokens"] == got["tokens"]
        assert choice["logprobs"]["top_logprobs"] == got["top_logprobs"]


def test_chat_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    data = json.loads(r.choices[0].message.content)
    assert set(data) == {"name", "age"}
    assert isinstance(data["name"], str) and isinstance(data["age"], int)


def test_chat_json_object(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Give me a JSON object with a color."}],
        response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_chat_structural_tag(server):
    """vLLM's response_format structural_tag: the reply is the tagged block, its
    content valid for the schema."""
    schema = {"type": "object", "properties": {"color": {"type": "string"}},
              "required": ["color"]}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"}, json={
                       "model": MODEL_NAME, "max_tokens": 40, "temperature": 0,
                       "messages": [{"role": "user", "content": "Pick a color."}],
                       "response_format": {"type": "structural_tag", "format": {
                           "type": "tag", "begin": "<pick>", "end": "</pick>",
                           "content": {"type": "json_schema", "json_schema": schema}}}})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert content.startswith("<pick>") and content.endswith("</pick>"), content
    assert set(json.loads(content[len("<pick>"):-len("</pick>")])) == {"color"}


# ------------------------------------------------------------------ load, disconnects

def test_concurrent_streams_keep_health_fast(server):
    """32 streaming requests sent at once all finish with exact counts while /health,
    timed from another process, answers within 100 ms as they stream. While the 32
    arrive it may wait longer: the event loop parses, validates and queues all 32
    (~100 ms of CPU on a 2-core VM, shared with this client), and /health waits its
    turn; a stall, though, would be seconds."""
    num_requests, max_tokens = 32, 8
    first_chunk_at: list[float] = []
    finished_at: list[float] = []

    async def run() -> list[tuple[int, int]]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                                     max_retries=0, timeout=300)

        async def one(i: int) -> tuple[int, int]:
            stream = await aclient.completions.create(
                model=MODEL_NAME, prompt=f"Story number {i}:", max_tokens=max_tokens,
                temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            num_chunks, usage = 0, None
            async for chunk in stream:
                if chunk.choices and not num_chunks:
                    first_chunk_at.append(time.monotonic())
                num_chunks += bool(chunk.choices)
                usage = chunk.usage or usage
            finished_at.append(time.monotonic())
            return usage.completion_tokens, num_chunks

        return await asyncio.gather(*(one(i) for i in range(num_requests)))

    probe = HealthProbe(server.port)
    try:
        results = asyncio.run(run())
    finally:
        latencies = probe.stop()
    assert all(tokens == max_tokens and chunks >= 1 for tokens, chunks in results), results
    assert len(latencies) > 10 and all(status == 200 for _, status, _ in latencies)
    worst = max(lat for lat, _, _ in latencies)
    assert worst < 0.5, f"/health took {worst * 1000:.0f} ms"
    # Probes sent once every stream had its first token and before the last one ended.
    streaming = [lat for lat, _, start in latencies
                 if max(first_chunk_at) <= start <= max(finished_at)]
    assert len(streaming) >= 3, (len(streaming), max(finished_at) - max(first_chunk_at))
    assert max(streaming) < 0.1, f"/health took {max(streaming) * 1000:.0f} ms mid-stream"


def _wait_idle(server: RemoteServer) -> dict:
    """The engine's stats once nothing runs or waits (after at most ~10 s)."""
    for _ in range(100):
        stats = server.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        time.sleep(0.1)
    return stats


def test_disconnect_mid_stream_frees_request(server):
    body = {"model": MODEL_NAME, "prompt": "Tell me a very long story.", "max_tokens": 500,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers=server.headers, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert server.stats()["num_running"] == 1
    # The connection is closed: the request must be aborted and its blocks freed.
    stats = _wait_idle(server)
    assert stats["num_running"] == 0 and stats["num_front_end_requests"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1
    metrics = httpx.get(server.url + "/metrics", headers=server.headers).text
    assert f'pagedllm:num_requests_running{{model_name="{MODEL_NAME}"}} 0.0' in metrics
    assert 'finished_reason="abort"' in metrics


def test_disconnect_non_streaming_frees_request(server):
    body = {"model": MODEL_NAME, "prompt": "Write an essay.", "max_tokens": 500,
            "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                   timeout=3)
    stats = _wait_idle(server)
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"] - 1


# ------------------------------------------------------------------ errors

LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 10)

BAD_REQUESTS = [
    # (id, path, raw body or json, expected status, text the message must contain)
    ("invalid-json", "/v1/completions", b'{"prompt": "x", ', 400, "JSON"),
    ("prompt-wrong-type", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("temperature-wrong-type", "/v1/completions", {"prompt": "x", "temperature": "hot"},
     400, "temperature"),
    ("negative-max-tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400,
     "max_tokens"),
    ("n-zero", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("bad-top-p", "/v1/completions", {"prompt": "x", "top_p": 7}, 400, "top_p"),
    ("empty-prompt-list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("token-out-of-vocab", "/v1/completions", {"prompt": [10 ** 9]}, 400, "vocab"),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("unknown-model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
    ("prompt-too-long", "/v1/completions", {"prompt": LONG_PROMPT}, 400,
     str(MAX_MODEL_LEN)),
    ("prompt-plus-max-tokens-too-long", "/v1/completions",
     {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "maximum context length"),
    ("chat-missing-messages", "/v1/chat/completions", {"model": MODEL_NAME}, 400,
     "messages"),
    ("chat-empty-messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("chat-top-logprobs-too-many", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
      "top_logprobs": 50}, 400, "top_logprobs"),
    ("chat-bad-response-format", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     400, "response_format"),
    # Once killed the engine: the sampler cannot seed with more than 64 bits.
    ("seed-too-large", "/v1/completions", {"prompt": "x", "seed": 2 ** 70}, 400, "seed"),
    ("bad-regex", "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(["}},
     400, "regex"),
    ("chat-max-completion-tokens-zero", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_tokens"),
    ("chat-image-content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "x"}}]}]}, 400, "text"),
    ("chat-prompt-too-long", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, str(MAX_MODEL_LEN)),
]


@pytest.mark.parametrize("path,body,status,needle", [b[1:] for b in BAD_REQUESTS],
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_openai_error(server, path, body, status, needle):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, headers=server.headers | {
        "content-type": "application/json"}, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    payload = r.json()
    assert payload["object"] == "error"
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status
    assert needle in error["message"], error["message"]


def test_prompt_too_long_message_gives_both_numbers(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=1)
    message = e.value.body["message"]
    assert str(MAX_MODEL_LEN) in message
    assert str(num_tokens(server, LONG_PROMPT)) in message


def test_api_key_required(server):
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # Every route but /health needs the key (no --metrics-without-key here).
    for method, path in (("GET", "/v1/models"), ("GET", "/version"), ("GET", "/metrics"),
                         ("GET", "/debug/stats"), ("GET", "/docs"), ("GET", "/openapi.json"),
                         ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("POST", "/v1/chat/completions")):
        r = httpx.request(method, server.url + path, json={"prompt": "x", "tokens": [1]})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401, path
        r = httpx.request(method, server.url + path, headers=server.headers,
                          json={"prompt": "x", "tokens": [1]})
        assert r.status_code != 401, path
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.head(server.url + "/health").status_code == 200
    # SageMaker's health check is open too; its inference route is not.
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200
    r = httpx.post(server.url + "/invocations", json=body)
    assert r.status_code == 401


def test_invocations_answer_as_the_api_their_body_is_for(server, client):
    """SageMaker's POST /invocations (as vLLM's): chat for `messages`, completions for
    `prompt`, embeddings for `input`, each answered as that route answers."""
    def invoke(body: dict) -> httpx.Response:
        return httpx.post(server.url + "/invocations", json=body, headers=server.headers,
                          timeout=60)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = invoke({"messages": messages, "max_tokens": 6, "temperature": 0}).json()
    direct = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                            max_tokens=6, temperature=0)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == direct.choices[0].message.content
    completion = invoke({"prompt": "The capital of France is", "max_tokens": 5,
                         "temperature": 0}).json()
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=5,
        temperature=0).choices[0].text
    embedding = invoke({"input": "hello"}).json()
    assert embedding["object"] == "list"
    direct_vector = client.embeddings.create(model=MODEL_NAME, input="hello").data[0].embedding
    assert embedding["data"][0]["embedding"] == pytest.approx(direct_vector, abs=1e-6)
    # vLLM's /pooling: a decoder's own task is embedding.
    pooled = httpx.post(server.url + "/pooling", json={"input": ["hello", "world"]},
                        headers=server.headers, timeout=60).json()
    assert [d["index"] for d in pooled["data"]] == [0, 1]
    assert pooled["data"][0]["data"] == pytest.approx(direct_vector, abs=1e-6)
    streamed = httpx.post(server.url + "/invocations", headers=server.headers, timeout=60,
                          json={"prompt": "Hi", "max_tokens": 3, "stream": True})
    assert streamed.text.rstrip().endswith("data: [DONE]")
    # A body for no API, and a body that is not valid for the one it names.
    r = invoke({"max_tokens": 3})
    assert r.status_code == 400 and "messages (chat)" in r.json()["error"]["message"]
    r = invoke({"prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert invoke([1, 2]).status_code == 400


def test_request_chat_template_is_off_by_default(server, client):
    with pytest.raises(openai.BadRequestError, match="trust-request-chat-template"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            extra_body={"chat_template": "{{ messages[0].content }}"})
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            extra_body={"chat_template_kwargs": {"chat_template": "{{ 1 }}"}})


def test_server_survives_bad_requests(server, client):
    for body in (b"\xff\xfe", b"[]", b"null", b'{"prompt": {"a": 1}}'):
        r = httpx.post(server.url + "/v1/completions", content=body,
                       headers=server.headers | {"content-type": "application/json"})
        assert r.status_code == 400, (body, r.text)
    r = httpx.post(server.url + "/v1/nope", headers=server.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = client.completions.create(model=MODEL_NAME, prompt="Still alive?", max_tokens=2)
    assert r.usage.completion_tokens >= 1


# ------------------------------------------------------------------ metrics

def _samples(server: RemoteServer) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted((labels | {"model_name": MODEL_NAME}).items())))
    return samples.get(key, 0.0)


def test_metrics_parse_and_move(server, client):
    before = _samples(server)
    prompt = "Metrics are"
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    after = _samples(server)
    num_prompt = num_tokens(server, prompt)
    for name, delta in (("pagedllm:prompt_tokens_total", num_prompt),
                        ("pagedllm:generation_tokens_total", 3),
                        ("pagedllm:time_to_first_token_seconds_count", 1),
                        ("pagedllm:e2e_request_latency_seconds_count", 1),
                        ("pagedllm:request_queue_time_seconds_count", 1),
                        ("pagedllm:time_per_output_token_seconds_count", 1),
                        ("pagedllm:prefix_cache_queries_total", num_prompt)):
        assert _value(after, name) - _value(before, name) == delta, name
    name = "pagedllm:request_success_total"
    assert (_value(after, name, finished_reason="length")
            - _value(before, name, finished_reason="length")) == 1
    for gauge in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
                  "pagedllm:kv_cache_usage_perc"):
        assert _value(after, gauge) == 0.0
    # The same prompt again is served from the prefix cache (if it spans a full block).
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 4
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=1)
    final = _samples(server)
    assert _value(final, "pagedllm:prefix_cache_hits_total") > _value(
        after, "pagedllm:prefix_cache_hits_total")


def test_stats_log_line(server):
    """The periodic throughput line appears in the server log while it is busy."""
    log = server.read_log()
    assert "Avg prompt throughput" in log and "Prefix cache hit rate" in log


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, client):
    """vLLM's truncate_prompt_tokens: completions and chat keep the prompt's last k tokens
    (-1: max_model_len) before the length checks; echo shows the kept text."""
    ids = httpx.post(server.url + "/tokenize", headers=server.headers,
                     json={"prompt": "One, two, three, four, five, six,"}).json()["tokens"]
    k = 5
    cut = client.completions.create(model=MODEL_NAME, prompt="One, two, three, four, five, six,",
                                    max_tokens=4, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": k})
    last = client.completions.create(model=MODEL_NAME, prompt=ids[-k:], max_tokens=4,
                                     temperature=0, echo=True)
    assert cut.usage.prompt_tokens == k
    assert cut.choices[0].text == last.choices[0].text  # the kept tokens' text, then the same
    # A prompt longer than the context is refused, unless truncated to it.
    long_ids = (ids * (MAX_MODEL_LEN // len(ids) + 1))[:MAX_MODEL_LEN + 50]
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, json={
        "model": MODEL_NAME, "prompt": long_ids, "max_tokens": 2})
    assert r.status_code == 400
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, json={
        "model": MODEL_NAME, "prompt": long_ids, "max_tokens": 2,
        "truncate_prompt_tokens": MAX_MODEL_LEN - 2}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 2
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Count: one, two, three"}],
        max_tokens=2, extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    for value, message in [(0, "must be an integer >= 1, or -1"),
                           (MAX_MODEL_LEN + 1, "greater than max_model_len")]:
        r = httpx.post(server.url + "/v1/completions", headers=server.headers, json={
            "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2,
            "truncate_prompt_tokens": value})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
