"""Hundreds of malformed and hostile requests against a live server.

Every one must get a 4xx with OpenAI's error body (never a 5xx, never a hang), while a
separate process polls /health (< 100 ms throughout); afterwards the server still gives
the same greedy answer as before, its memory has not grown without bound, and a SIGTERM
ends it within seconds even while a hostile template is rendering.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.entrypoints.utils import MODEL_NAME, HealthProbe, RemoteServer

API_KEY = "fuzz-key"
MAX_MODEL_LEN = 512
RENDER_TIMEOUT_S = 2
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               "--num-kv-blocks", "128", "--max-num-seqs", "16",
               "--trust-request-chat-template", "--render-timeout", str(RENDER_TIMEOUT_S),
               # The stalled-stream test's client reads nothing until its request is
               # done; the write timeout itself is test_slow_clients.py's.
               "--write-timeout", "600"]
VOCAB_SIZE = 49152

# A template that loops for ever (well: 10^15 iterations) and one that nests deeper.
NESTED_LOOP_TEMPLATE = ("{% for a in range(100000) %}{% for b in range(100000) %}"
                        "{% for c in range(100000) %}x{% endfor %}{% endfor %}{% endfor %}")
DEEP_LOOP_TEMPLATE = "".join("{% for i" + str(k) + " in range(100000) %}" for k in range(6)) \
    + "y" + "{% endfor %}" * 6


# JSON nested past Python's recursion limit (its decoder, pickling and recursive walks
# raised RecursionError: a 500), and a dict nested past the request depth limit.
TOO_DEEP_TEXT = "[" * 5000 + "]" * 5000
DEEP_DICT: dict = {}
for _ in range(500):
    DEEP_DICT = {"type": "array", "items": DEEP_DICT}
DEEP_LIST: list = []
for _ in range(300):
    DEEP_LIST = [DEEP_LIST]


@dataclass
class Case:
    """One hostile request and the status it must get (any 4xx when None)."""

    name: str
    path: str = "/v1/completions"
    body: Any = None
    raw: bytes | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    status: int | None = None
    auth: bool = True


def _completion(**fields: Any) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4} | fields


def _chat(**fields: Any) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4} | fields


# Bad values of the sampling fields shared by both endpoints.
BAD_SAMPLING_VALUES: dict[str, list[Any]] = {
    "n": [0, -1, 1_000_000_000, 2**64, 1.5, None],
    "best_of": [1_000_000_000, -3],
    "temperature": [-1, "hot", float("nan"), float("inf"), -float("inf"), 1e300, 101],
    "top_p": [0, 1.5, -0.1, float("nan"), "x"],
    "top_k": [0, -2, 2**40, 1.5, "k"],
    "min_p": [-0.1, 1.5, float("nan")],
    "presence_penalty": [3, -3, float("inf")],
    "frequency_penalty": [2.5, float("nan")],
    "repetition_penalty": [0, -1, float("inf")],
    "logit_bias": [{"a": 1}, {"-1": 1}, {"1": "x"}, [1, 2], {str(VOCAB_SIZE + 7): 1},
                   {"1": 1e400}],
    "seed": [2**64, "x", -(2**64), 1.5],
    "stop": [123, [1], [""], ["s"] * 65, ["\ud800"], {"a": 1}],
    "stop_token_ids": [[-1], [10**9], "x", list(range(65)), [2**70]],
    "min_tokens": [-1, 2**40, "x"],
    "allowed_token_ids": [[], [-1], [10**9], "x"],
    "bad_words": [[""], [1], ["w"] * 65],
    "prompt_logprobs": [21, 49152, -1, "x"],
    "structured_outputs": [{"regex": "("}, {"json": "{bad"}, {}, {"choice": []},
                           {"json": {"type": "nonsense"}}, {"grammar": "root ::= ("},
                           {"regex": "a", "choice": ["b"]}, "x",
                           # unhashable where a string belongs: the cache key (a 500)
                           {"regex": [[1]]}, {"json": [[1]]}, {"json_object": [[1]]},
                           {"regex": "a", "disable_any_whitespace": []},
                           {"json_object": "yes"}, {"json": DEEP_DICT},
                           {"json": TOO_DEEP_TEXT}, {"structural_tag": TOO_DEEP_TEXT}],
    "guided_regex": ["(", 5],
    "guided_json": ["{bad", 5, TOO_DEEP_TEXT],
    "guided_choice": [[], "x"],
    "priority": ["x", 1, 1.5],
    "timeout": [-1, 0, "x", float("nan"), float("inf")],
    "model": ["nope", 5],
    "stream": ["maybe", 2],
    "stream_options": [{"foo": 1}, "x", {"include_usage": True}],  # the last: no stream
    "ignore_eos": ["x"],
    "skip_special_tokens": [[]],
    "user": [123],
    "request_id": [{"a": 1}],
    "max_tokens": [0, -1, "a", 1.5, 1e30, 2**70, MAX_MODEL_LEN],
    "unknown_field": [1, "x"],
    "store": [True],
    "metadata": [{"k": "v"}],
    "service_tier": ["flex"],
}

COMPLETION_ONLY: dict[str, list[Any]] = {
    "prompt": [None, 5, {"a": 1}, [], [[]], [-1], [VOCAB_SIZE], [1e10], [["a"]], True,
               "He\ud800llo", ["ok", "\udfff"], "", [[1], "mixed"],
               [[1]] * 200, "word " * 600, list(range(1, 600))],
    "logprobs": [21, -1, "x", 10**9],
    "echo": ["x"],
    "suffix": ["tail"],
    "tools": [[{"type": "function", "function": {"name": "f"}}]],
}

CHAT_ONLY: dict[str, list[Any]] = {
    "messages": [None, [], [{}], [{"role": 1, "content": "x"}], "hi", [{"content": "x"}],
                 [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": "http://x"}}]}],
                 [{"role": "user", "content": "\ud800"}],
                 [{"role": "user", "content": "x", "extra": 1}],
                 [{"role": "assistant", "content": None,
                   "tool_calls": [{"id": "1", "type": "function",
                                   "function": {"name": "f", "arguments": "{}"}}]}],
                 [{"role": "tool", "content": "r", "tool_call_id": "1"}],
                 [{"role": "user", "content": "word " * 600}],
                 [{"role": "user", "content": "x"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "f", "arguments": TOO_DEEP_TEXT}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "r"}],
                 [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                 [{"role": "user", "content": [{"type": "text"}]}]],
    "logprobs": ["x", 3],
    "top_logprobs": [21, -1, 5],  # 5 without logprobs=true is an error too
    "max_completion_tokens": [-1, "x", 10**6],
    "response_format": [{"type": "xml"}, "json", {"type": "json_schema",
                                                  "json_schema": {"schema": "x"}},
                        {"type": "json_schema", "json_schema": {"name": "s", "extra": 1}}],
    "tools": [[{"type": "function", "function": {"name": "f", "parameters": {}}}], "x",
              [{"type": "function", "function": {"name": "f", "parameters": {"$schema": [1]}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"$schema": {}}}}]],
    "tool_choice": ["required", {"type": "function", "function": {"name": "f"}}],
    "functions": [[{"name": "f"}]],
    "function_call": ["auto"],
    "audio": [{"voice": "alloy"}],
    "modalities": [["audio"]],
    "reasoning_effort": ["maximal", 3],
    "chat_template_kwargs": [{"chat_template": "{{ 1 }}"}, {"tokenize": True}, "x",
                             {"x": DEEP_LIST}],
    "chat_template": ["{% if %}", "{{ raise_exception('no') }}", 5,
                      NESTED_LOOP_TEMPLATE, DEEP_LOOP_TEMPLATE],
    "add_generation_prompt": ["x"],
    "continue_final_message": [{"a": 1}],
    "echo": [[]],
}


def _field_cases() -> list[Case]:
    cases = []
    for path, make, fields in (("/v1/completions", _completion,
                                BAD_SAMPLING_VALUES | COMPLETION_ONLY),
                               ("/v1/chat/completions", _chat,
                                BAD_SAMPLING_VALUES | CHAT_ONLY)):
        for name, values in fields.items():
            for value in values:
                body = make(**{name: value})
                if name == "top_logprobs" and value == 5:
                    body["logprobs"] = False
                status = 404 if name == "model" and value == "nope" else None
                cases.append(Case(f"{path} {name}={str(value)[:40]!r}", path, body=body,
                                  status=status))
    return cases


def _raw_cases() -> list[Case]:
    json_type = {"content-type": "application/json"}
    cases = [Case(f"raw body {raw[:30]!r}", raw=raw, headers=json_type) for raw in (
        b"", b"{", b'{"prompt": "x",}', b"\xff\xfe", b"[]", b"null", b'"x"', b"123",
        b'{"prompt": "x"} trailing', b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b'{"prompt": "\\ud800"}',
        b'{"prompt": "x", "prompt": 5}', b'{"prompt": NaN}', b"\x00\x01\x02")]
    cases += [
        Case("text/plain body", raw=json.dumps(_completion()).encode(),
             headers={"content-type": "text/plain"}),
        Case("form body", raw=b"prompt=x&max_tokens=2",
             headers={"content-type": "application/x-www-form-urlencoded"}),
        Case("body over --max-body-bytes", raw=b'{"prompt": "' + b"a" * (3 << 20) + b'"}',
             headers=json_type, status=413),
        Case("chunked body over the limit", raw=b"", headers=json_type, status=413),
    ]
    return cases


def _route_cases() -> list[Case]:
    big_prompt = "ab " * 400_000  # 1.2 MB: over --max-prompt-bytes (1 MiB), under the body
    cases = [
        Case("GET completions", method="GET", status=405),
        Case("PUT chat", path="/v1/chat/completions", method="PUT", body={}, status=405),
        Case("unknown route", path="/v1/nope", body={}, status=404),
        Case("unknown route GET", path="/admin", method="GET", status=404),
        Case("tokenize both", path="/tokenize",
             body={"prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
        Case("tokenize neither", path="/tokenize", body={}),
        Case("tokenize huge prompt", path="/tokenize", body={"prompt": big_prompt}),
        Case("tokenize surrogate", path="/tokenize", body={"prompt": "\ud800"}),
        Case("tokenize unknown field", path="/tokenize", body={"prompt": "x", "k": 1}),
        Case("chat huge content", path="/v1/chat/completions",
             body=_chat(messages=[{"role": "user", "content": big_prompt}])),
        Case("completion huge prompt", body=_completion(prompt=big_prompt)),
        Case("many prompts", body=_completion(prompt=["x"] * 129)),
        Case("prompts x n", body=_completion(prompt=["x"] * 10, n=20)),
        # SageMaker's route: a body for no API, one that is no object, and bad bodies of
        # the APIs it picks (checked as theirs).
        Case("invocations for no API", path="/invocations", body={"max_tokens": 1}),
        Case("invocations list", path="/invocations", body=[{"prompt": "x"}]),
        Case("invocations bad chat", path="/invocations", body={"messages": "hi"}),
        Case("invocations bad prompt", path="/invocations", body={"prompt": [[-1]]}),
        Case("invocations 20k messages", path="/invocations",
             body={"messages": [{}] * 20_000}),
        Case("invocations unknown field", path="/invocations",
             body={"input": "x", "k": 1}),
        Case("pooling unknown task", path="/pooling", body={"input": "x", "task": "x"}),
        Case("pooling task the model lacks", path="/pooling",
             body={"input": "x", "task": "classify"}),
        Case("pooling no input", path="/pooling", body={"input": []}),
        # The response store is off here: what needs it is a 400 naming the flag; the
        # routes that read it do not exist.
        Case("responses previous id", path="/v1/responses",
             body={"input": "x", "previous_response_id": "resp_" + "a" * 10_000}),
        Case("get a response", path="/v1/responses/resp_x", method="GET", status=404),
        Case("responses background", path="/v1/responses",
             body={"input": "x", "background": True}),
        Case("cancel a response", path="/v1/responses/resp_x/cancel", status=404),
        # truncation "auto" over 30,000 turns, the last one too long alone: ~15 renders
        # of up to all of them (off the event loop), then the 400.
        Case("responses truncation of 30,000 turns", path="/v1/responses", body={
            "input": [{"role": "user", "content": "hi"}] * 30_000
            + [{"role": "user", "content": "hi " * MAX_MODEL_LEN}],
            "truncation": "auto", "max_output_tokens": 2}),
        Case("responses 100,000 includes", path="/v1/responses",
             body={"input": "x", "include": ["x" * 8] * 100_000}),
        Case("responses include not a string", path="/v1/responses",
             body={"input": "x", "include": [{"a": 1}]}),
        Case("responses top_logprobs huge", path="/v1/responses", body={
            "input": "x", "include": ["message.output_text.logprobs"],
            "top_logprobs": 10**12}),
        Case("detokenize negative", path="/detokenize", body={"tokens": [-1]}),
        Case("detokenize huge id", path="/detokenize", body={"tokens": [10**10]}),
        Case("detokenize string", path="/detokenize", body={"tokens": "x"}),
        Case("prompt_logprobs on a 100-token prompt", body=_completion(
            prompt=list(range(1, 101)), prompt_logprobs=VOCAB_SIZE)),
        Case("echo + logprobs 49152", body=_completion(echo=True, logprobs=VOCAB_SIZE)),
        Case("best_of < n", body=_completion(n=3, best_of=2)),
        # Each bad item was an error of every union member: a 3.5 MB answer, built on
        # the event loop.
        Case("prompt of 20k objects", body=_completion(prompt=[{}] * 20_000)),
        Case("chat of 20k empty messages", path="/v1/chat/completions",
             body=_chat(messages=[{}] * 20_000)),
        # Two constraints: one was silently dropped.
        Case("guided_choice and guided_regex",
             body=_completion(guided_choice=["yes", "no"], guided_regex="[0-9]+")),
        Case("structured_outputs and guided_json", body=_completion(
            structured_outputs={"regex": "a"}, guided_json={"type": "object"})),
        Case("response_format and guided_json", path="/v1/chat/completions",
             body=_chat(response_format={"type": "json_object"},
                        guided_json={"type": "array"})),
        Case("chat echo of a non-string text part", path="/v1/chat/completions",
             body=_chat(echo=True, messages=[
                 {"role": "user", "content": "x"},
                 {"role": "assistant", "content": [{"type": "text", "text": None}]}])),
        Case("responses deep call arguments", path="/v1/responses", body={"input": [
            {"type": "function_call", "call_id": "c1", "name": "f",
             "arguments": TOO_DEEP_TEXT},
            {"type": "function_call_output", "call_id": "c1", "output": "r"}]}),
        Case("responses tool $schema not a string", path="/v1/responses", body={
            "input": "x", "tools": [{"type": "function", "name": "f",
                                     "parameters": {"$schema": [1]}}]}),
        Case("prompt + max_tokens > max_model_len",
             body=_completion(prompt=list(range(1, 500)), max_tokens=100)),
        Case("score 2049 pairs", path="/v1/score", body={"text_1": "q", "text_2": ["d"] * 2049}),
        Case("score huge text", path="/v1/score", body={"text_1": big_prompt, "text_2": "d"}),
        Case("score past max_model_len", path="/v1/score",
             body={"text_1": "q", "text_2": "word " * 600}),
        Case("score no pairs", path="/v1/score", body={"text_1": "q", "text_2": []}),
        Case("score ids", path="/score", body={"text_1": [1, 2], "text_2": "d"}),
        Case("score surrogate", path="/v1/score", body={"text_1": "\ud800", "text_2": "d"}),
        Case("score truncate 0", path="/v1/score",
             body={"text_1": "q", "text_2": "d", "truncate_prompt_tokens": 0}),
        Case("rerank documents not a list", path="/v1/rerank",
             body={"query": "q", "documents": "d"}),
        Case("rerank top_n -1", path="/rerank",
             body={"query": "q", "documents": ["d"], "top_n": -1}),
        Case("responses huge input", path="/v1/responses", body={"input": big_prompt}),
        Case("responses bad item", path="/v1/responses", body={"input": [{"type": "x"}]}),
        Case("responses item not an object", path="/v1/responses", body={"input": [5]}),
        Case("responses web search", path="/v1/responses",
             body={"input": "x", "tools": [{"type": "web_search"}]}),
        Case("responses tool_choice required without tools", path="/v1/responses",
             body={"input": "x", "tool_choice": "required"}),
        Case("rerank unknown model", path="/v2/rerank",
             body={"model": "nope", "query": "q", "documents": ["d"]}, status=404),
    ]
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/score"), ("POST", "/v1/rerank"),
                         ("POST", "/v1/responses"),
                         ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("GET", "/debug/stats"), ("GET", "/metrics"), ("GET", "/docs"),
                         ("GET", "/version")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                        {"Authorization": "Basic " + API_KEY}):
            cases.append(Case(f"{method} {path} auth {headers}", path=path, method=method,
                              body=_completion(), headers=headers, status=401, auth=False))
    return cases


def all_cases() -> list[Case]:
    return _field_cases() + _raw_cases() + _route_cases()


def _chunked_body():
    yield b'{"prompt": "'
    for _ in range(40):
        yield b"a" * 100_000
    yield b'"}'


def send(client: httpx.Client, case: Case) -> httpx.Response:
    headers = dict(case.headers)
    if case.auth:
        headers.setdefault("Authorization", f"Bearer {API_KEY}")
    if case.name == "chunked body over the limit":
        return client.request(case.method, case.path, content=_chunked_body(),
                              headers=headers)
    if case.raw is not None:
        return client.request(case.method, case.path, content=case.raw, headers=headers)
    if case.body is None:
        return client.request(case.method, case.path, headers=headers)
    # allow_nan: NaN/Infinity are what hostile clients send (Python's json accepts them).
    return client.request(case.method, case.path, headers=headers | {
        "content-type": "application/json"}, content=json.dumps(case.body).encode())


def check_error_response(case: Case, r: httpx.Response) -> str | None:
    """Why the response is wrong, or None."""
    if case.status is not None and r.status_code != case.status:
        return f"status {r.status_code}, expected {case.status}: {r.text[:200]}"
    if not 400 <= r.status_code < 500:
        return f"status {r.status_code}: {r.text[:200]}"
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {r.text[:200]}"
    if len(r.content) > 16384:  # a message naming every bad item of a list was 52 MB
        return f"an error body of {len(r.content)} bytes: {r.text[:200]}"
    if not (isinstance(error.get("message"), str) and error["message"]
            and isinstance(error.get("type"), str) and error.get("code") == r.status_code):
        return f"bad error fields: {error}"
    return None


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS, api_key=API_KEY, key_in_env=True)
    yield srv
    srv.stop()


def _greedy(client: httpx.Client) -> str:
    r = client.post("/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                    json=_completion(prompt="The capital of France is", max_tokens=12,
                                     temperature=0))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _rss(server: RemoteServer) -> tuple[int, int]:
    stats = server.stats()
    return stats["api_rss_bytes"], stats["engine_rss_bytes"]


def test_hostile_requests_get_4xx_and_never_stall(server):
    cases = all_cases()
    assert len(cases) >= 200
    client = httpx.Client(base_url=server.url, timeout=60)
    reference = _greedy(client)
    rss_before = _rss(server)
    probe = HealthProbe(server.port)
    failures, slow = [], []
    try:
        for case in cases:
            start = time.monotonic()
            try:
                r = send(client, case)
            except httpx.TransportError as e:  # e.g. the connection a 500 closed
                failures.append(f"{case.name}: {type(e).__name__}: {e}")
                continue
            elapsed = time.monotonic() - start
            problem = check_error_response(case, r)
            if problem:
                failures.append(f"{case.name}: {problem}")
            # Nothing may take much longer than the render time limit.
            if elapsed > RENDER_TIMEOUT_S + 3:
                slow.append(f"{case.name}: {elapsed:.1f} s")
    finally:
        latencies = probe.stop()
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(
        failures)
    assert not slow, slow
    assert len(latencies) > 20 and all(status == 200 for _, status, _ in latencies)
    worst = max(lat for lat, _, _ in latencies)
    assert worst < 0.1, f"/health took {worst * 1000:.0f} ms"
    # The server still answers, and answers the same.
    assert _greedy(client) == reference
    stats = server.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1
    api_growth, engine_growth = (after - before for after, before in zip(_rss(server),
                                                                          rss_before))
    assert api_growth < 300 << 20 and engine_growth < 300 << 20, (api_growth, engine_growth)


def test_looping_template_is_cut_off_and_sigterm_still_stops_the_server():
    """A request template that never ends is stopped at --render-timeout; meanwhile the
    server still answers, and SIGTERM (while several such renders run and a generation
    streams) ends the process within seconds."""
    srv = RemoteServer(SERVER_ARGS + ["--request-timeout", "60"], api_key=API_KEY)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        start = time.monotonic()
        r = httpx.post(srv.url + "/v1/chat/completions", headers=headers, timeout=30,
                       json=_chat(chat_template=NESTED_LOOP_TEMPLATE))
        assert r.status_code == 400 and "--render-timeout" in r.json()["error"]["message"]
        assert time.monotonic() - start < RENDER_TIMEOUT_S + 2

        def hostile() -> None:
            try:
                httpx.post(srv.url + "/v1/chat/completions", headers=headers, timeout=30,
                           json=_chat(chat_template=DEEP_LOOP_TEMPLATE))
            except httpx.HTTPError:
                pass

        threads = [threading.Thread(target=hostile) for _ in range(3)]
        for t in threads:
            t.start()
        with httpx.stream("POST", srv.url + "/v1/completions", headers=headers, timeout=30,
                          json=_completion(max_tokens=400, ignore_eos=True,
                                           stream=True)) as stream:
            next(stream.iter_lines())
            assert httpx.get(srv.url + "/health", timeout=1).status_code == 200
            srv.proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            srv.proc.wait(15)
        assert time.monotonic() - start < 12, "SIGTERM took too long"
        for t in threads:
            t.join(30)
    finally:
        srv.stop()


def test_a_grammar_compiling_for_seconds_holds_back_only_its_own_request(server):
    """An enum of 60,000 strings (~0.9 MB, under the body limit) takes xgrammar seconds
    to compile; requests sent meanwhile are answered at once, not after it."""
    enum = [f"item{i}" for i in range(60000)]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    result: dict[str, Any] = {}

    def ask_with_grammar() -> None:
        with httpx.Client(base_url=server.url, timeout=300) as c:
            result["r"] = c.post("/v1/completions", headers=auth, json=_completion(
                prompt="Pick one:", max_tokens=16, temperature=0,
                structured_outputs={"json": {"enum": enum}}))

    grammar_thread = threading.Thread(target=ask_with_grammar)
    grammar_thread.start()
    client = httpx.Client(base_url=server.url, timeout=60)
    deadline = time.monotonic() + 30
    while server.stats()["num_waiting"] == 0:  # arrived (compiling counts as waiting)
        assert grammar_thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    answers = [_greedy(client) for _ in range(3)]
    # Before the fix each of these waited for the compile, which ran in the engine loop.
    assert grammar_thread.is_alive(), "the grammar compiled before the plain requests"
    grammar_thread.join(300)
    r = result["r"]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert json.loads(choice["text"]) in enum and choice["finish_reason"] == "stop"
    assert len(set(answers)) == 1


def _tree_cpu_seconds(pid: int) -> float:
    """CPU time used so far by the process and its live descendants."""
    import psutil

    total = 0.0
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _wait_until_idle(pid: int, timeout_s: float = 60.0) -> None:
    """Until the server's processes use under a tenth of a core for a second (a server
    just started still warms up its grammar compiler)."""
    deadline = time.monotonic() + timeout_s
    cpu = _tree_cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(1)
        cpu, before = _tree_cpu_seconds(pid), cpu
        if cpu - before < 0.1:
            return
    raise AssertionError(f"the server was still busy after {timeout_s} s")


def test_a_constraint_that_parses_for_minutes_is_cut_off_and_nothing_works_on_it(server):
    """A JSON schema of ~3 KB whose 60 patterns xgrammar expands for about a minute
    (quadratic in the count of `(a|b){1,3000}`, which parsing cannot interrupt) is
    refused once it has used --render-timeout of CPU, and then nothing of the server
    works on it any more (its parse ran in a thread that went on for the minute); sent
    again it is refused at once, and grammar requests are served after it."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    schema = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": "(a|b){1,3000}"} for i in range(60)}}
    _wait_until_idle(server.proc.pid)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/completions", headers=auth, json=_completion(
            prompt="Fill in:", max_tokens=8, structured_outputs={"json": schema}))
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "--render-timeout" in message
        cpu = _tree_cpu_seconds(server.proc.pid)
        time.sleep(2)
        assert _tree_cpu_seconds(server.proc.pid) - cpu < 0.5
        start = time.monotonic()
        r = c.post("/v1/chat/completions", headers=auth, json=_chat(
            max_tokens=8, structured_outputs={"json": schema}))
        assert r.status_code == 400 and r.json()["error"]["message"] == message
        assert time.monotonic() - start < 1
        r = c.post("/v1/completions", headers=auth, json=_completion(
            prompt="My phone number is", max_tokens=12, temperature=0,
            structured_outputs={"regex": r"\d{3}-\d{4}"}))
        assert r.status_code == 200, r.text
        assert re.fullmatch(r"\d{3}-\d{4}", r.json()["choices"][0]["text"])


def test_a_grammar_over_the_compile_limit_gets_a_400_and_the_compiler_recovers():
    """A grammar whose compile runs over --grammar-compile-timeout is killed (with the
    compiler process) and its request answered as invalid, naming the limit, for every
    sample of an n > 1 request and as a stream's error event; plain and grammar
    requests are served as before, the next grammar by a new compiler process."""
    srv = RemoteServer(SERVER_ARGS + ["--grammar-compile-timeout", "0.5"], api_key=API_KEY)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    heavy = {"json": {"enum": [f"item{i}" for i in range(60000)]}}  # ~5 s of CPU
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            before = _greedy(c)
            r = c.post("/v1/completions", headers=auth, json=_completion(
                prompt="Pick one:", n=2, max_tokens=8, structured_outputs=heavy))
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert "structured_outputs" in message and "grammar_compile_timeout" in message
            with c.stream("POST", "/v1/chat/completions", headers=auth, json=_chat(
                    stream=True, max_tokens=8, structured_outputs=heavy)) as s:
                body = s.read().decode()
            assert "grammar_compile_timeout" in body and '"code":400' in body.replace(" ", "")
            r = c.post("/v1/completions", headers=auth, json=_completion(
                prompt="My phone number is", max_tokens=12, temperature=0,
                structured_outputs={"regex": r"\d{3}-\d{4}"}))
            assert r.status_code == 200, r.text
            assert re.fullmatch(r"\d{3}-\d{4}", r.json()["choices"][0]["text"])
            assert _greedy(c) == before
            stats = srv.stats()
            assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    finally:
        srv.stop()


def test_a_client_that_stops_reading_its_stream_costs_one_output_per_request(server):
    """A streamed n=16 request with logprobs whose client sends it and then reads
    nothing until it is done. The engine makes an output every step regardless; they
    were queued for the client one by one (each cumulative: every token so far), so the
    server grew with the square of the length for as long as the client held on. Now the
    newest output replaces the one waiting, and the logprobs are stored flat: when the
    client reads at last it gets every token in fewer events than tokens, and the front
    end has not grown by more than 8 MB meanwhile (it grew by 33 MB before; 0.1 MB now)."""
    n, max_tokens = 16, 400
    body = json.dumps(_completion(prompt="Once upon a time", n=n, max_tokens=max_tokens,
                                  ignore_eos=True, temperature=0, logprobs=20,
                                  stream=True)).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few events
    sock.connect(("127.0.0.1", server.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\n".encode()
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        rss_before = _rss(server)[0]
        deadline = time.monotonic() + 240
        time.sleep(1)
        while server.stats()["num_running"] or server.stats()["num_waiting"]:
            assert time.monotonic() < deadline, "the stalled request did not finish"
            time.sleep(0.5)
        api_growth = _rss(server)[0] - rss_before
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 200
        events = [line[len(b"data: "):] for line in response.read().split(b"\n\n")
                  if line.startswith(b"data: ")]
    finally:
        sock.close()
    assert events[-1] == b"[DONE]"
    tokens = {i: 0 for i in range(n)}
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            tokens[choice["index"]] += len((choice["logprobs"] or {}).get("tokens") or [])
    assert tokens == {i: max_tokens for i in range(n)}  # nothing lost
    assert api_growth < 8 * 2**20, api_growth
    # One event per token and choice was queued before (6,400); now the socket buffers'
    # worth (~3,100 of these events: the server's send buffer, Linux's tcp_wmem up to
    # 4 MB) and then one event per choice with everything since.
    assert len(events) < 0.8 * n * max_tokens, len(events)
