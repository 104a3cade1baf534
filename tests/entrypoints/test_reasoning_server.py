"""--reasoning-parser on the chat API: replies carry the reasoning in `reasoning` (and
vLLM's older `reasoning_content`), streams deliver the same split, tool calls and
structured outputs read only the answer after the reasoning. A scripted model
(tests/utils.py:save_scripted_llama) writes known outputs word for word."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoints.utils import RemoteServer
from tests.utils import save_scripted_llama

CALL = ['<tool_call>', '{"name":', '"get_weather",', '"arguments":', '{"city":',
        '"Paris"}}', '</tool_call>']
# go -> <think> hmm well </think> <tool_call> ... </tool_call>; ponder -> hmm well </think>
# ...; plain -> text done.
SCRIPT = {"go": "<think>", "<think>": "hmm", "hmm": "well", "well": "</think>",
          "</think>": CALL[0], **dict(zip(CALL, CALL[1:])), "ponder": "hmm",
          "plain": "text", "text": "done", "ok": "yes", "yes": "no"}
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_scripted_llama(tmp_path_factory.mktemp("scripted"), SCRIPT, TEMPLATE)
    srv = RemoteServer([str(path), "--dtype", "float32", "--max-model-len", "64",
                        "--num-kv-blocks", "64", "--reasoning-parser", "deepseek_r1",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    yield srv
    srv.stop()


def chat(server, text: str, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 16,
            "temperature": 0} | fields
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def stream(server, text: str, **fields) -> tuple[dict, list[dict]]:
    """(the deltas joined into one message, the raw deltas) of a streamed reply."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 16,
            "temperature": 0, "stream": True} | fields
    deltas, finish = [], None
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                deltas.append(choice["delta"])
                finish = choice["finish_reason"] or finish
    joined = {"finish_reason": finish}
    for key in ("content", "reasoning", "reasoning_content"):
        parts = [d[key] for d in deltas if d.get(key)]
        joined[key] = "".join(parts) if parts else None
    joined["tool_calls"] = [c for d in deltas for c in d.get("tool_calls") or []]
    return joined, deltas


def test_reasoning_and_answer_are_split(server):
    choice = chat(server, "go")
    message = choice["message"]
    assert message["reasoning"].split() == ["hmm", "well"]
    assert message["reasoning_content"] == message["reasoning"]
    assert message["content"].split() == CALL  # no tools asked: the call is plain text
    joined, deltas = stream(server, "go")
    assert joined["reasoning"] == message["reasoning"]
    assert joined["reasoning_content"] == message["reasoning"]
    assert joined["content"] == message["content"]
    assert joined["finish_reason"] == choice["finish_reason"] == "stop"
    # Reasoning arrives before the answer, never in the same delta as content.
    kinds = [("reasoning" in d, bool(d.get("content"))) for d in deltas]
    assert not any(r and c for r, c in kinds)
    first_content = next(i for i, (_, c) in enumerate(kinds) if c)
    assert not any(r for r, _ in kinds[first_content:])


def test_reasoning_without_a_start_tag_and_unclosed(server):
    assert chat(server, "ponder")["message"]["reasoning"].split() == ["hmm", "well"]
    # deepseek_r1: an output that never closes its reasoning is all reasoning.
    message = chat(server, "plain")["message"]
    assert message["reasoning"].split() == ["text", "done"] and message["content"] is None
    joined, _ = stream(server, "plain")
    assert joined["reasoning"] == message["reasoning"] and joined["content"] is None


def test_tool_calls_are_read_after_the_reasoning(server):
    choice = chat(server, "go", tools=[WEATHER])
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["reasoning"].split() == ["hmm", "well"] and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    joined, _ = stream(server, "go", tools=[WEATHER])
    assert joined["finish_reason"] == "tool_calls" and joined["content"] is None
    assert joined["reasoning"] == message["reasoning"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in joined["tool_calls"]] == [("get_weather", {"city": "Paris"})]


def test_structured_output_constrains_the_answer_only(server):
    choice = chat(server, "go", structured_outputs={"choice": ["yes", "no"]})
    assert choice["message"]["reasoning"].split() == ["hmm", "well"]
    assert choice["message"]["content"].strip() in ("yes", "no")
    # The prompt closed the reasoning (as Qwen3's enable_thinking=false does): the
    # grammar holds from the first token and there is no reasoning.
    choice = chat(server, "go <think> </think>", structured_outputs={"choice": ["yes", "no"]})
    assert "reasoning" not in choice["message"]
    assert choice["message"]["content"].strip() in ("yes", "no")


def test_include_reasoning_false_drops_it(server):
    message = chat(server, "go", include_reasoning=False)["message"]
    assert "reasoning" not in message and "reasoning_content" not in message
    assert message["content"].split() == CALL
    joined, _ = stream(server, "go", include_reasoning=False)
    assert joined["reasoning"] is None and joined["content"] == message["content"]


def test_conversations_carry_reasoning_on_assistant_messages(server):
    messages = [{"role": "user", "content": "ok"},
                {"role": "assistant", "content": "yes", "reasoning_content": "hmm"},
                {"role": "user", "content": "plain"}]
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": messages, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    bad = [{"role": "user", "content": "go", "reasoning": "no"}]
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": bad, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400
    assert "`reasoning` is only allowed in assistant messages" in r.json()["error"]["message"]
