"""Server options vLLM users set: HTTPS (--ssl-*), CORS (--allowed-origins, on by
default for any origin as vLLM), --root-path behind a proxy,
--enable-prompt-tokens-details (usage.prompt_tokens_details.cached_tokens) and
--return-tokens-as-token-ids (also per request), --enable-log-requests /
--enable-log-outputs / --max-log-len, --enable-per-request-metrics. One HTTPS server
with all of them on; the bundled model."""

from __future__ import annotations

import base64
import io
import json
import re
import signal
import time

import httpx
import msgspec
import pytest
import torch
import zmq

from tests.entrypoints.utils import MODEL_NAME, RemoteServer

ORIGIN = "http://ui.example"
KEY = "sk-options"
# 40 words: two full 16-token blocks at least, so a repeat hits the prefix cache.
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 5)
MAX_LOG_LEN = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    tmp = tmp_path_factory.mktemp("tls")
    ca.cert_pem.write_to_path(str(tmp / "ca.pem"))
    cert.private_key_pem.write_to_path(str(tmp / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp / "cert.pem"))
    srv = RemoteServer(["--max-model-len", "256", "--ssl-keyfile", str(tmp / "key.pem"),
                        "--ssl-certfile", str(tmp / "cert.pem"), "--allowed-origins",
                        f'["{ORIGIN}"]', "--root-path", "/api",
                        "--enable-prompt-tokens-details", "--return-tokens-as-token-ids",
                        "--enable-log-requests", "--enable-log-outputs",
                        "--max-log-len", str(MAX_LOG_LEN), "--enable-per-request-metrics"],
                       api_key=KEY, ca_file=str(tmp / "ca.pem"))
    yield srv
    srv.stop()


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=60,
                      verify=server.verify, **kw)


def test_https_only(server):
    assert server.url.startswith("https://")
    assert httpx.get(server.url + "/health", verify=server.verify).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url.replace("https", "http") + "/health", timeout=5)


def test_cors(server):
    """A browser's preflight is answered before the key check; answers (401s too)
    carry the origin; other origins get no grant."""
    preflight = httpx.options(server.url + "/v1/chat/completions", verify=server.verify,
                              headers={"Origin": ORIGIN,
                                       "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    denied = httpx.get(server.url + "/v1/models", verify=server.verify,
                       headers={"Origin": ORIGIN})
    assert denied.status_code == 401
    assert denied.headers["access-control-allow-origin"] == ORIGIN
    # A part of the allowed origin is another origin (the list was once read as its
    # JSON text, and a substring of that text passed).
    for origin in ("http://evil.example", ORIGIN[:-2], "ui.example"):
        other = httpx.get(server.url + "/v1/models", verify=server.verify,
                          headers={"Origin": origin} | server.headers)
        assert other.status_code == 200
        assert "access-control-allow-origin" not in other.headers, origin


def test_root_path(server):
    """Behind a proxy that strips /api, the docs link to the prefixed paths."""
    r = httpx.get(server.url + "/openapi.json", verify=server.verify, headers=server.headers)
    assert r.status_code == 200
    assert {"url": "/api"} in r.json().get("servers", [])


def test_cached_tokens_in_usage(server):
    body = {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0}
    _post(server, "/v1/completions", body)
    again = _post(server, "/v1/completions", body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": LONG_PROMPT}],
            "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    _post(server, "/v1/chat/completions", chat | {"stream": False, "stream_options": None})
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat,
                      headers=server.headers, verify=server.verify, timeout=60) as r:
        usage = [line for line in r.iter_lines() if '"usage":{' in line]
    assert '"cached_tokens":' in usage[-1] and '"cached_tokens":0' not in usage[-1]


def test_tokens_as_token_ids(server):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0,
            "logprobs": 2, "echo": True}
    logprobs = _post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in logprobs["tokens"])
    assert all(k.startswith("token_id:") for top in logprobs["top_logprobs"] if top
               for k in top)
    # A request may ask for text back.
    plain = _post(server, "/v1/completions", body | {"return_tokens_as_token_ids": False})
    assert not plain.json()["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    content = _post(server, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"][
        "content"]
    token_id = int(content[0]["token"].removeprefix("token_id:"))
    assert content[0]["bytes"] == list(f"token_id:{token_id}".encode())
    assert all(t["token"].startswith("token_id:") for t in content[0]["top_logprobs"])


def test_requests_and_outputs_are_logged(server):
    body = {"model": MODEL_NAME, "prompt": "A secret prompt", "max_tokens": 9,
            "temperature": 0, "ignore_eos": True, "logit_bias": {str(i): 0.5 for i in range(50)}}
    r = _post(server, "/v1/completions", body)
    request_id = r.json()["id"]
    ids = r.json()["choices"][0]  # (text only: tokens are ids under this server's option)
    embedding = _post(server, "/v1/embeddings", {"model": MODEL_NAME, "input": "x"}).json()
    log = server.read_log()
    received = re.search(rf"Received request {request_id}-0: params: SamplingParams\((.*)\), "
                         rf"lora_request: None\.", log)
    assert received, log[-3000:]
    params = received.group(1)
    # The fields that differ from the defaults, each value's repr cut at --max-log-len.
    assert "max_tokens=9" in params and "temperature=0.0" in params
    assert "ignore_eos=True" in params and "logit_bias={0: 0." in params
    assert "top_p=" not in params  # a default
    assert "A secret" not in log  # prompts go to DEBUG only
    generated = re.search(rf"Generated response {request_id}-0 \(sequence 0\): output: "
                          rf"'(.*)', output_token_ids \(9\): \[(.*)\], finish_reason: length\.",
                          log)
    assert generated, log[-3000:]
    assert generated.group(1) == ids["text"][:MAX_LOG_LEN]
    assert len(generated.group(2).split(",")) == MAX_LOG_LEN
    assert re.search(r"Received request embd-\w+-0: params: PoolingParams\(", log)
    # A request without request_id is named after its X-Request-Id (vLLM's ids).
    for path, body, prefix in (("/v1/completions", {"prompt": "Hi"}, "cmpl"),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "Hi"}]},
                                "chatcmpl")):
        r = httpx.post(server.url + path, timeout=60, verify=server.verify,
                       headers={**server.headers, "X-Request-Id": "trace-7"},
                       json={"model": MODEL_NAME, "max_tokens": 2, **body})
        assert r.json()["id"] == f"{prefix}-trace-7"
        assert f"Received request {prefix}-trace-7-0: params" in server.read_log()
    hidden = len(embedding["data"][0]["embedding"])
    assert re.search(rf"Finished request embd-\w+-0: {hidden} floats, finish_reason: stop",
                     log)


class TagAnswers:
    """A pure ASGI middleware (--middleware by class): every answer carries a header."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-tagged", b"class")]}
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


async def tag_function(request, call_next):
    """An HTTP middleware function (--middleware by function)."""
    response = await call_next(request)
    response.headers["x-tagged-by-function"] = "yes"
    return response


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A second server (plain HTTP) with the options the first cannot take."""
    traces = tmp_path_factory.mktemp("traces")
    kv_events = {"enable_kv_cache_events": True, "topic": "kv",
                 "endpoint": f"ipc://{traces}/kv", "replay_endpoint": f"ipc://{traces}/replay"}
    srv = RemoteServer(["--max-model-len", "256", "--disable-fastapi-docs",
                        "--kv-events-config", json.dumps(kv_events),
                        "--enable-request-id-headers", "--enable-force-include-usage",
                        "--disable-log-requests", "--response-role", "bot",
                        "--logits-processors",
                        "tests.engine.test_logits_processors:ForceToken",
                        "tests.engine.test_logits_processors:Faulty",
                        "--enable-sleep-mode", "--profiler-dir", str(traces),
                        "--enable-prompt-embeds", "--enable-server-load-tracking",
                        "--middleware", "tests.entrypoints.test_server_options:TagAnswers",
                        "--middleware", "tests.entrypoints.test_server_options.tag_function",
                        "--enable-uvicorn-access-log", "--logging-config.formatter", "json"])
    srv.kv_replay = kv_events["replay_endpoint"]
    yield srv
    srv.stop()


def test_docs_off_request_ids_and_forced_usage(plain):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(plain.url + path).status_code == 404, path
    # X-Request-Id: the client's own, else a new one on every answer (errors too).
    r = httpx.get(plain.url + "/v1/models", headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    ids = {httpx.get(plain.url + "/health").headers["x-request-id"] for _ in range(2)}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)
    assert "x-request-id" in httpx.get(plain.url + "/nope").headers
    # Every stream ends with usage, asked for or not.
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "stream": True}
    for path, extra in (("/v1/completions", {}),
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "Hi"}]})):
        request = {k: v for k, v in (body | extra).items()
                   if not (path.endswith("chat/completions") and k == "prompt")}
        with httpx.stream("POST", plain.url + path, json=request, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: {")]
        usage = json.loads(events[-1].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 3, path
    assert "Received request" not in plain.read_log()


def test_logits_processors_and_vllm_xargs(plain):
    """--logits-processors by qualified name; a request opts in with vllm_xargs (the
    OpenAI client's extra_body), and a bad value is its 400."""
    client = plain.openai_client()
    out = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4,
                                    logprobs=0, extra_body={"vllm_xargs": {"force": 42},
                                                            "return_tokens_as_token_ids": True})
    assert out.choices[0].logprobs.tokens == ["token_id:42"] * 4
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=3, logprobs=True,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"vllm_xargs": {"force": 43},
                                                      "return_tokens_as_token_ids": True})
    assert [t.token for t in chat.choices[0].logprobs.content] == ["token_id:43"] * 3
    # Without vllm_xargs the processor leaves the request alone.
    plain_out = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4,
                                          temperature=0)
    assert plain_out.choices[0].text.strip()
    r = httpx.post(plain.url + "/v1/completions", timeout=30, json={
        "model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "vllm_xargs": {"force": -1}})
    assert r.status_code == 400
    assert "ForceToken: force must be a token id, got -1" in r.json()["error"]["message"]


def test_a_failing_logits_processor_is_its_requests_500(plain):
    """A processor that raises fails that request with a 500 naming it (in the stream:
    an error event), and the engine serves the next requests."""
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(plain.url + "/v1/completions", timeout=30,
                   json=body | {"vllm_xargs": {"fail": "step"}})
    assert r.status_code == 500, r.text
    assert ("logits processor tests.engine.test_logits_processors.Faulty failed on this "
            "request: ZeroDivisionError: step 2") in r.json()["error"]["message"]
    with httpx.stream("POST", plain.url + "/v1/completions", timeout=30,
                      json=body | {"stream": True, "vllm_xargs": {"fail": "new_request"}}
                      ) as streamed:
        text = streamed.read().decode()
    assert "KeyError: 'no table for this prompt'" in text and "data: [DONE]" in text
    again = httpx.post(plain.url + "/v1/completions", timeout=30, json=body)
    assert again.status_code == 200
    assert again.json()["usage"]["completion_tokens"] == 5


def test_middleware_by_import_path(plain):
    """--middleware: a class and an async function, both on every answer (errors too);
    a path that names neither is refused at start-up. And the access log's lines."""
    from pagedllm.entrypoints.openai.server import import_middleware
    from pagedllm.errors import ConfigError

    for path in ("/health", "/v1/models", "/nope"):
        r = httpx.get(plain.url + path, timeout=10)
        assert r.headers["x-tagged"] == "class", path
        assert r.headers["x-tagged-by-function"] == "yes", path
    # --enable-uvicorn-access-log: a line per request, though uvicorn logs at WARNING;
    # --logging-config.formatter json: uvicorn's, the front end's and the engine
    # process's records are JSON objects, one a line.
    records = [json.loads(line) for line in plain.read_log().splitlines()
               if line.startswith("{")]
    messages = {r["message"] for r in records if r["name"] == "uvicorn.access"}
    assert {'"GET /v1/models HTTP/1.1" 200', '"GET /nope HTTP/1.1" 404'} <= {
        m.split(" - ", 1)[1] for m in messages}
    processes = {r["pagedllm_process"] for r in records}
    assert {"api_server", "engine_core"} <= processes, processes
    for path, fragment in (("json:dumps", "neither a class nor an async function"),
                           ("no_such_mod_q:X", "No module named"),
                           ("json:nope", "module 'json' has no 'nope'")):
        with pytest.raises(ConfigError, match=fragment):
            import_middleware(path)


def test_reset_prefix_cache(plain):
    """POST /reset_prefix_cache: the same prompt again hits nothing; 409 while a stream
    holds blocks."""
    prompt = "A long and repeated prompt about the sea and its tides. " * 6
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}

    def hits_of_one_request() -> int:
        before = plain.stats()["prefix_cache_hits"]
        httpx.post(plain.url + "/v1/completions", json=body, timeout=60)
        return plain.stats()["prefix_cache_hits"] - before

    hits_of_one_request()
    assert hits_of_one_request() > 0
    # The engine process publishes its KV cache events (--kv-events-config): the
    # prompt's blocks were stored, and the reset clears them.
    prompt_ids = httpx.post(plain.url + "/tokenize", json={"model": MODEL_NAME,
                            "prompt": prompt}, timeout=30).json()["tokens"]
    stored = [e for e in kv_events(plain.kv_replay) if e[0] == "BlockStored"]
    assert any(e[2] is None and e[3] == prompt_ids[:len(e[3])] for e in stored), stored
    assert httpx.post(plain.url + "/reset_prefix_cache", timeout=30).status_code == 200
    assert kv_events(plain.kv_replay)[-1] == ["AllBlocksCleared"]
    assert hits_of_one_request() == 0
    stream = body | {"max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", plain.url + "/v1/completions", json=stream, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        busy = httpx.post(plain.url + "/reset_prefix_cache", timeout=30)
        assert busy.status_code == 409 and "while requests are running" in busy.text
        assert "data: [DONE]" in list(lines)


def kv_events(replay_endpoint: str) -> list[list]:
    """Every KV event batch the replay socket still holds, flattened (vLLM's msgpack
    arrays: [kind, fields...]); tests/engine/test_kv_events.py checks them in depth."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(replay_endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    events = []
    try:
        while True:
            assert sock.poll(10_000), "no replay answer"
            _, seq, payload = sock.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return events
            ts, batch, rank = msgspec.msgpack.decode(payload)
            events += batch
    finally:
        sock.close(linger=0)


def test_server_load_tracking(plain):
    """GET /load counts the requests in flight: a stream until its last event."""
    def load() -> int:
        return httpx.get(plain.url + "/load", timeout=10).json()["server_load"]

    assert load() == 0
    body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 40, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", plain.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert load() == 1
        assert "data: [DONE]" in list(lines)
    # The count drops once the server's handler returns, just after the last event.
    deadline = time.monotonic() + 5
    while load() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load() == 0
    httpx.post(plain.url + "/v1/completions", timeout=60,
               json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert load() == 0


def test_prompt_embeds(plain):
    """--enable-prompt-embeds: the completions API's prompt_embeds (base64 of
    torch.save), the bundled model's own embeddings of a prompt, give what its tokens
    give (one, or a list of them streamed); bad ones are 400s."""
    import gguf

    from pagedllm.config import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    table = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
    url = plain.url + "/v1/completions"
    ids = httpx.post(plain.url + "/tokenize", timeout=30, json={
        "model": MODEL_NAME, "prompt": "The capital of France is"}).json()["tokens"]
    buf = io.BytesIO()
    torch.save(table[torch.tensor(ids)].clone(), buf)
    data = base64.b64encode(buf.getvalue()).decode()
    body = {"model": MODEL_NAME, "max_tokens": 10, "temperature": 0}
    by_ids = httpx.post(url, timeout=60, json=body | {"prompt": ids}).json()
    by_rows = httpx.post(url, timeout=60, json=body | {"prompt_embeds": data}).json()
    assert by_rows["choices"][0]["text"] == by_ids["choices"][0]["text"]
    assert by_rows["usage"] == by_ids["usage"]
    with httpx.stream("POST", url, timeout=60,
                      json=body | {"prompt_embeds": [data, data], "stream": True}) as r:
        chunks = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines()
                  if line.startswith("data: {")]
    for index in (0, 1):
        assert "".join(c["choices"][0]["text"] for c in chunks
                       if c["choices"] and c["choices"][0]["index"] == index) \
            == by_ids["choices"][0]["text"]
    nan = io.BytesIO()
    torch.save(torch.full((3, table.shape[1]), float("nan")), nan)
    for extra, fragment in (({"prompt_embeds": "%%"}, "not valid base64"),
                            ({"prompt_embeds": base64.b64encode(nan.getvalue()).decode()},
                             "NaN or infinite"),
                            ({"prompt_embeds": base64.b64encode(buf.getvalue()).decode(),
                              "repetition_penalty": 1.3}, "repetition_penalty counts"),
                            ({"prompt_embeds": data, "prompt": "x"}, "exactly one of"),
                            ({"prompt_embeds": data, "echo": True}, "echo needs"),
                            ({"prompt_embeds": []}, "must not be empty")):
        r = httpx.post(url, timeout=30, json=body | extra)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_sleep_and_wake_up(plain):
    """--enable-sleep-mode: POST /sleep (409 while a request runs), requests 503 while
    asleep, POST /wake_up (the weights first at level 2), then the same greedy reply."""
    body = {"model": MODEL_NAME, "prompt": "Name three colors:", "max_tokens": 8,
            "temperature": 0}
    url = plain.url

    def complete() -> httpx.Response:
        return httpx.post(url + "/v1/completions", json=body, timeout=60)

    expected = complete().json()["choices"][0]["text"]
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json=body | {"max_tokens": 200, "ignore_eos": True,
                                   "stream": True}) as r:
        lines = r.iter_lines()  # kept: a closed iterator would close the stream
        next(lines)
        busy = httpx.post(url + "/sleep", timeout=30)
        assert busy.status_code == 409, busy.text
        assert "requests are unfinished" in busy.json()["error"]["message"]
        # The stream goes on to its end.
        assert sum(1 for line in lines if line.startswith("data: {")) > 100
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    assert httpx.post(url + "/sleep", params={"level": 1}, timeout=30).status_code == 200
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
    asleep = complete()
    assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200
    for path, params, fragment in (("/sleep", {"level": 3}, "sleep level must be 1"),
                                   ("/sleep", {"level": 10 ** 30}, "sleep level must be 1"),
                                   ("/wake_up", {"tags": "bogus"}, "wake_up tags"),
                                   ("/wake_up", {"tags": ["x"] * 5000}, "wake_up tags")):
        r = httpx.post(url + path, params=params, timeout=30)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
        assert len(r.json()["error"]["message"]) < 300
    # Deeper: the weights too, then woken in two steps.
    assert httpx.post(url + "/sleep", params={"level": 2}, timeout=30).status_code == 200
    assert httpx.post(url + "/wake_up", params={"tags": "weights"},
                      timeout=60).status_code == 200
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
    assert complete().status_code == 503
    assert httpx.post(url + "/wake_up", timeout=60).status_code == 200
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    assert complete().json()["choices"][0]["text"] == expected


def test_profiler_routes(plain):
    """--profiler-dir: POST /start_profile, a request, POST /stop_profile names the
    trace written (a second stop is a 400)."""
    assert httpx.post(plain.url + "/start_profile", timeout=30).status_code == 200
    httpx.post(plain.url + "/v1/completions", timeout=60,
               json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    r = httpx.post(plain.url + "/stop_profile", timeout=60)
    (path,) = r.json()["traces"]
    with open(path) as f:
        assert json.load(f)["traceEvents"]
    r = httpx.post(plain.url + "/stop_profile", timeout=30)
    assert r.status_code == 400 and "not recording" in r.json()["error"]["message"]


def test_response_role(plain):
    """--response-role names the replies' role (after the generation prompt; a
    continued last message keeps its own), streamed or not."""
    client = plain.openai_client()
    hi = [{"role": "user", "content": "Hi"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=hi, max_tokens=2)
    assert reply.choices[0].message.role == "bot"
    first = next(iter(client.chat.completions.create(model=MODEL_NAME, messages=hi,
                                                     max_tokens=2, stream=True)))
    assert first.choices[0].delta.role == "bot"
    continued = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=2, extra_body={
            "continue_final_message": True, "add_generation_prompt": False},
        messages=hi + [{"role": "assistant", "content": "Hello"}])
    assert continued.choices[0].message.role == "assistant"


# Runs last in this module: it stops the server.
def _check_timing(metrics: dict, num_tokens: int) -> None:
    assert set(metrics) == {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms",
                            "mean_itl_ms", "tokens_per_second"}
    assert all(v is not None and v >= 0 for v in metrics.values()), metrics
    assert metrics["mean_itl_ms"] == pytest.approx(
        metrics["generation_time_ms"] / (num_tokens - 1))
    inference_s = (metrics["time_to_first_token_ms"] + metrics["generation_time_ms"]) / 1000
    assert metrics["tokens_per_second"] == pytest.approx(num_tokens / inference_s, rel=1e-6)
    # A 2-core VM decodes SmolLM2 at tens of ms a token, not microseconds or minutes.
    assert 0.1 < metrics["mean_itl_ms"] < 10_000


def test_per_request_metrics(server):
    """vLLM's `metrics`: on a whole response, and on a stream's usage chunk only."""
    body = {"model": MODEL_NAME, "prompt": "Count: one, two,", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    _check_timing(r.json()["metrics"], 6)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}
    for options, usage_chunk in ((None, False), ({"include_usage": True}, True)):
        events = _post(server, "/v1/chat/completions", chat | (
            {"stream_options": options} if options else {})).text.split("\n\n")
        chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        assert not any("metrics" in c for c in chunks[:-1])
        if usage_chunk:
            _check_timing(chunks[-1]["metrics"], 5)
        else:
            assert "metrics" not in chunks[-1]


def test_ctrl_c_stops_the_server_quietly(server):
    """SIGINT (Ctrl-C in a terminal) shuts the server down as SIGTERM does; uvicorn
    raises the signal again once it is down, which printed a KeyboardInterrupt
    traceback."""
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(30) == 130
    log = server.read_log()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]

