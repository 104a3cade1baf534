"""`pagedllm serve --config FILE.yaml` (vLLM's), and the options it sets here: --uds (a
Unix domain socket), --default-chat-template-kwargs, --exclude-tools-when-tool-choice-none,
--disable-access-log-for-endpoints, --shutdown-timeout, --stream-interval,
--sse-keep-alive-interval, --kv-cache-metrics and --custom-histogram-buckets. One server,
the bundled
model, every option from the file; the command line overrides the file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from pagedllm.entrypoints.cli import build_parser, config_file_args
from pagedllm.entrypoints.openai.serving_common import KEEP_ALIVE, with_keep_alive
from pagedllm.errors import ConfigError
from tests.entrypoints.utils import MODEL_NAME, RemoteServer

# Shows the tools it is given and a template variable, then the conversation.
TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}"
            "{% endif %}V={{ custom_var | default('unset') }}|{% for m in messages %}"
            "{{ m.role }}:{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("config_file")
    uds = str(tmp / "pagedllm.sock")
    (tmp / "serve.yaml").write_text(yaml.safe_dump({
        "uds": uds, "max_model_len": 256, "max-num-seqs": 8,
        "chat-template": TEMPLATE,
        "default_chat_template_kwargs": {"custom_var": "from-the-server"},
        "exclude_tools_when_tool_choice_none": True,
        "enable-uvicorn-access-log": True,
        "disable_access_log_for_endpoints": "/health,/load",
        "enable-prefix-caching": False, "shutdown_timeout": 0,
        "max_n": 2, "stream_interval": 4, "sse_keep_alive_interval": 0.005,
        "max_num_queued_reqs": 3, "num-kv-blocks": 64, "kv-cache-metrics": True,
        "kv-cache-metrics-sample": 1.0,
        "custom-histogram-buckets": {"time_to_first_token": [0.5, 1, 100]}}))
    # The command line wins over the file.
    srv = RemoteServer(["--config", str(tmp / "serve.yaml"), "--max-n", "3"], uds=uds)
    yield srv
    srv.stop()


def rendered(client, **body) -> str:
    ids = client.post("/tokenize", json={"model": MODEL_NAME, **body}).json()["tokens"]
    return client.post("/detokenize", json={"model": MODEL_NAME,
                                            "tokens": ids}).json()["prompt"]


def test_unix_socket_and_template_defaults(server):
    with server.client() as client:
        assert client.get("/health").status_code == 200
        hello = [{"role": "user", "content": "hi"}]
        assert rendered(client, messages=hello) == "V=from-the-server|user:hi\nassistant:"
        # A request's own chat_template_kwargs win over the server's defaults.
        assert rendered(client, messages=hello, chat_template_kwargs={
            "custom_var": "mine"}).startswith("V=mine|")
        assert rendered(client, messages=hello, tools=TOOLS).startswith(
            "TOOLS:get_weather;V=")


def test_tools_left_out_when_tool_choice_is_none(server):
    def prompt_tokens(**extra) -> int:
        with server.client() as client:
            r = client.post("/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain
    assert prompt_tokens(tools=TOOLS, tool_choice="required") > plain


def test_file_options_and_command_line_override(server):
    with server.client() as client:
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}
        assert client.post("/v1/completions", json=body | {"n": 3}).status_code == 200
        r = client.post("/v1/completions", json=body | {"n": 4})
        assert r.status_code == 400 and "--max-n" in r.text
        # Non-streamed and pooling requests wait for their one output whatever
        # --stream-interval says.
        embedding = client.post("/v1/embeddings", json={"model": MODEL_NAME, "input": "x"})
        assert embedding.status_code == 200 and embedding.json()["data"][0]["embedding"]
        for path in ("/health", "/load", "/v1/models", "/health?x=1"):
            client.get(path)
    access = [json_line for json_line in server.read_log().splitlines()
              if "HTTP/1.1\" " in json_line]
    assert any("GET /v1/models " in line for line in access), access
    assert not any("/health" in line or "/load" in line for line in access), access


def test_kv_cache_metrics_and_custom_buckets(server):
    """Every block sampled: once the 63 usable blocks have all been handed out, blocks
    handed out again end their stays (lifetime and idle histograms); TTFT takes the
    file's bounds."""
    words = " ".join(f"word{i}" for i in range(70))  # ~230 tokens: ~15 blocks each
    with server.client() as client:
        for i in range(5):
            r = client.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": f"{i} {words}", "max_tokens": 1})
            assert r.status_code == 200, r.text
        text = client.get("/metrics").text

    def value(line_start: str) -> float:
        (line,) = [x for x in text.splitlines() if x.startswith(line_start)]
        return float(line.rsplit(" ", 1)[1])

    assert value("pagedllm:kv_block_lifetime_seconds_count") > 0
    assert value("pagedllm:kv_block_idle_before_evict_seconds_count") \
        == value("pagedllm:kv_block_lifetime_seconds_count")
    assert "pagedllm:kv_block_reuse_gap_seconds_count" in text
    bounds = re.findall(r'pagedllm:time_to_first_token_seconds_bucket\{le="([^"]+)"', text)
    assert bounds == ["0.5", "1.0", "100.0", "+Inf"]


def test_stream_interval(server):
    """--stream-interval 4: the first token alone, then events of 4 tokens, the last
    one at the end; every token arrives once."""
    with server.client() as client:
        with client.stream("POST", "/v1/completions", json={
                "model": MODEL_NAME, "prompt": "Count:", "max_tokens": 14,
                "ignore_eos": True, "stream": True, "logprobs": 0,
                "temperature": 0}, timeout=60) as r:
            lines = r.iter_lines()
            events = [json.loads(line[6:]) for line in lines
                      if line.startswith("data: {")]
        whole = client.post("/v1/completions", json={
            "model": MODEL_NAME, "prompt": "Count:", "max_tokens": 14,
            "ignore_eos": True, "temperature": 0}, timeout=60).json()
    sizes = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events
             if e["choices"] and e["choices"][0]["logprobs"]]
    # [1, 4, 4, 4, 1] unless the server's reader fell behind (then events merge).
    assert sizes[0] == 1 and sum(sizes) == 14 and min(sizes[1:-1]) >= 4, sizes
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == \
        whole["choices"][0]["text"]


def test_keep_alive_comments():
    """An SSE comment after each quiet interval, the events unchanged; closing the
    stream closes its source."""
    closed = []

    async def slow():
        try:
            for i in range(3):
                await asyncio.sleep(0.06)
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def main():
        got = [e async for e in with_keep_alive(slow(), 0.02)]
        assert [e for e in got if e != KEEP_ALIVE] == [f"data: {i}\n\n" for i in range(3)]
        assert got.count(KEEP_ALIVE) >= 3 and got[0] == KEEP_ALIVE
        stream = with_keep_alive(slow(), 0.02)
        assert await stream.__anext__() == KEEP_ALIVE
        await stream.aclose()  # a client that left while the source waited
    asyncio.run(main())
    assert closed == [True, True]


def test_openai_client_reads_streams_with_keep_alives(server):
    """--sse-keep-alive-interval 0.005: comment lines between the events (a quiet 5 ms
    happens in every stream here); the official client skips them."""
    import openai

    with server.client() as client:
        with client.stream("POST", "/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8, "stream": True}, timeout=60) as r:
            lines = list(r.iter_lines())
    assert ": keep-alive" in lines and "data: [DONE]" in lines
    oai = openai.OpenAI(base_url="http://localhost/v1", api_key="none", max_retries=0,
                        http_client=httpx.Client(transport=httpx.HTTPTransport(
                            uds=server.uds)))
    chunks = list(oai.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"


def test_requests_in_flight_limit(server):
    """--max-num-queued-reqs 3: three open streams, the fourth request gets 503."""
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 250, "ignore_eos": True,
            "stream": True}
    with server.client() as client:
        with contextlib.ExitStack() as streams:
            readers = []  # kept: a dropped iter_lines() closes its stream
            for _ in range(3):
                r = streams.enter_context(client.stream("POST", "/v1/completions",
                                                        json=body, timeout=60))
                readers.append(r.iter_lines())
                assert next(line for line in readers[-1] if line.startswith("data: {"))
            refused = client.post("/v1/completions", json=body | {"stream": False})
        assert refused.status_code == 503 and "--max-num-queued-reqs 3" in refused.text
        assert refused.headers["Retry-After"]
        # The closed streams' places come back once the server sees them go.
        for _ in range(100):
            ok = client.post("/v1/completions", json=body | {"stream": False,
                                                              "max_tokens": 2})
            if ok.status_code != 503:
                break
            time.sleep(0.1)
        assert ok.status_code == 200, ok.text


def test_shutdown_timeout_zero_cuts_streams_at_once(server):
    """--shutdown-timeout 0: SIGTERM aborts a running stream instead of letting it
    finish (100 tokens: well within the default 3 s)."""
    rest: list[str] = []
    with server.client() as client:
        with client.stream("POST", "/v1/completions", json={
                "model": MODEL_NAME, "prompt": "Count:", "max_tokens": 100,
                "ignore_eos": True, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            server.proc.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.RemoteProtocolError):  # cut mid-stream
                for line in lines:
                    rest.append(line)
    assert "data: [DONE]" not in rest
    assert sum(line.startswith("data: {") for line in rest) < 99
    assert server.proc.wait(15) is not None


def test_config_file_errors(tmp_path):
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    cases = {"no_such_option: 1": "no option --no-such-option",
             "enable-prefix-caching: 3": "takes true or false",
             "- a\n- b": "must hold option: value lines",
             "port: [": "--config"}
    for text, message in cases.items():
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            config_file_args(serve, str(path))
    path.write_text("port: 1\n")
    run = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                          "--config", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "missing.yaml" in run.stderr
    assert config_file_args(serve, str(path)) == ["--port", "1"]
    path.write_text(json.dumps({"allowed_origins": ["https://a"], "middleware": ["m:X"],
                                "hf_overrides": {"a": 1}, "enable_lora": False}))
    assert config_file_args(serve, str(path)) == [
        "--allowed-origins", '["https://a"]', "--middleware", "m:X",
        "--hf-overrides", '{"a": 1}', "--no-enable-lora"]


def test_the_command_line_wins_and_keeps_its_model(tmp_path):
    """The file's options are defaults: the command line overrides them, appends to
    its lists, and its positional model is never taken for a list option's value."""
    from pagedllm.entrypoints.cli import _apply_config_file

    path = tmp_path / "serve.yaml"
    path.write_text("served-model-name: [a, b]\nport: 8123\nmax_model_len: 512\n"
                    "middleware: [x:Y]\nenable-prefix-caching: false\ntool-call-parser:\n")
    parser = build_parser()
    argv = ["serve", "--config", str(path), "my-model", "--port", "9000",
            "--middleware", "z:W"]
    _apply_config_file(parser, argv)
    ns = parser.parse_args(argv)
    assert (ns.model_pos, ns.served_model_name, ns.port, ns.max_model_len) == (
        "my-model", ["a", "b"], 9000, 512)
    assert ns.middleware == ["x:Y", "z:W"] and ns.enable_prefix_caching is False
    assert ns.tool_call_parser is None
