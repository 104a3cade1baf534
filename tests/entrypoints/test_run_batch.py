"""`pagedllm run-batch` (entrypoints/openai/run_batch.py): OpenAI's batch file format run
through the server's routes in-process. A scripted model (tests/utils.py) makes every
answer known word for word."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.openai.run_batch import LineError, parse_line
from tests.utils import save_scripted_llama

# plain -> text done </s>; ask -> yes no </s>
SCRIPT = {"plain": "text", "text": "done", "ask": "yes", "yes": "no"}
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _run(model: str, lines: list[str], *args: str, stdin: bool = False,
         tmp_path=None) -> tuple[list[dict], subprocess.CompletedProcess]:
    text = "\n".join(lines) + "\n"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", model,
           "--dtype", "float32", "--max-model-len", "64", "--num-kv-blocks", "64",
           "--disable-log-stats", *args]
    if stdin:
        cmd += ["-i", "-", "-o", "-"]
    else:
        (tmp_path / "in.jsonl").write_text(text)
        cmd += ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    result = subprocess.run(cmd, input=text if stdin else None, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 0, result.stderr
    out = result.stdout if stdin else (tmp_path / "out.jsonl").read_text()
    return [json.loads(line) for line in out.splitlines()], result


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(save_scripted_llama(tmp_path_factory.mktemp("scripted"), SCRIPT, TEMPLATE))


def test_a_batch_file_runs_in_order_through_every_route(model, tmp_path):
    lines = [
        _line("chat", "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "ask"}], "max_tokens": 4}),
        _line("completion", "/v1/completions",
              {"prompt": "plain", "max_tokens": 4, "temperature": 0}),
        "",  # blank lines are skipped
        _line("anthropic", "/v1/messages", {"model": model, "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "ask"}]}),
        _line("bad body", "/v1/completions", {"prompt": "plain", "max_tokens": -1}),
        _line("tokens", "/tokenize", {"prompt": "plain text"}),
        "{not json",
        _line("chat", "/v1/completions", {"prompt": "x"}),  # a repeated custom_id
        _line("streamed", "/v1/completions", {"prompt": "plain", "stream": True}),
        _line("get", "/v1/completions", {"prompt": "plain"}, method="GET"),
        _line("elsewhere", "/sleep", {}),
    ] + [_line(f"n{i}", "/v1/completions", {"prompt": "plain", "max_tokens": 4})
         for i in range(6)]
    # Two in flight at most: later lines finish first and still come out in order.
    out, result = _run(model, lines, "--max-concurrency", "2", tmp_path=tmp_path)
    assert [o["custom_id"] for o in out] == [
        "chat", "completion", "anthropic", "bad body", "tokens", None, "chat", "streamed",
        "get", "elsewhere"] + [f"n{i}" for i in range(6)]
    assert len({o["id"] for o in out}) == len(out)
    ok = {o["custom_id"]: o["response"] for o in out[:5]}
    assert ok["chat"]["status_code"] == 200
    assert ok["chat"]["body"]["choices"][0]["message"]["content"] == " yes no"
    assert ok["chat"]["request_id"] == ok["chat"]["body"]["id"]
    assert ok["completion"]["body"]["choices"][0]["text"] == " text done"
    assert ok["anthropic"]["body"]["content"] == [{"type": "text", "text": " yes no"}]
    assert ok["anthropic"]["body"]["stop_reason"] == "end_turn"
    assert ok["tokens"]["body"]["count"] == 2
    # A request the server refuses: its status and error body, as the server answers.
    assert ok["bad body"]["status_code"] == 400
    assert "max_tokens" in ok["bad body"]["body"]["error"]["message"]
    assert all(o["error"] is None for o in out[:5])
    # Lines that are no request: no response, an error saying why.
    errors = [o["error"]["message"] for o in out[5:10]]
    assert [o["response"] for o in out[5:10]] == [None] * 5
    assert "not valid JSON" in errors[0] and "earlier line" in errors[1]
    assert "cannot stream" in errors[2] and "POST" in errors[3]
    assert "not a batch route" in errors[4]
    assert all(o["response"]["body"]["choices"][0]["text"] == " text done"
               for o in out[10:])
    assert "run-batch: 16 requests, 10 answered 200, 6 not" in result.stderr


def test_stdin_to_stdout(model):
    out, _ = _run(model, [_line("one", "/v1/completions", {"prompt": "ask",
                                                            "max_tokens": 3})], stdin=True)
    assert [o["response"]["body"]["choices"][0]["text"] for o in out] == [" yes no"]


@pytest.mark.parametrize("text, message", [
    ('{"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}}',
     "custom_id"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": []}', "body"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}, "x": 1}',
     "'x'"),
    ('[1]', "JSON object"),
])
def test_lines_that_are_no_request(text, message):
    with pytest.raises(LineError, match=message):
        parse_line(text, set())


def test_unreadable_input_and_bad_flags_fail_before_loading(tmp_path, capsys):
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o",
                 str(tmp_path / "out.jsonl")]) == 2
    assert "cannot open" in capsys.readouterr().err
    (tmp_path / "in.jsonl").write_text("")
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                 str(tmp_path / "out.jsonl"), "--max-concurrency", "0"]) == 2
    assert "--max-concurrency" in capsys.readouterr().err
