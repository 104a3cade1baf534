"""vLLM's POST /v1/chat/completions/batch (serving_chat_batch.py): a list of
conversations, each answered as the chat route answers it alone, as choice i. A scripted
model (tests/utils.py) makes every reply known word for word."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.utils import RemoteServer
from tests.utils import save_scripted_llama

# ask -> yes no </s>; plain -> text done </s>
SCRIPT = {"ask": "yes", "yes": "no", "plain": "text", "text": "done"}
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
BATCH = "/v1/chat/completions/batch"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_scripted_llama(tmp_path_factory.mktemp("scripted"), SCRIPT, TEMPLATE)
    srv = RemoteServer([str(path), "--dtype", "float32", "--max-model-len", "64",
                        "--num-kv-blocks", "64", "--max-n", "3"])
    yield srv
    srv.stop()


def _post(server: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_each_conversation_is_the_chat_reply(server):
    conversations = [[{"role": "user", "content": "ask"}],
                     [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "plain"}],
                     [{"role": "user", "content": "ask"}]]
    fields = {"temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 1,
              "return_token_ids": True}
    r = _post(server, BATCH, {"messages": conversations, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    for choice, messages in zip(body["choices"], conversations):
        ref = _post(server, "/v1/chat/completions", {"messages": messages, **fields}).json()
        [one] = ref["choices"]
        assert choice["message"] == one["message"]
        assert choice["finish_reason"] == one["finish_reason"] == "stop"
        assert choice["token_ids"] == one["token_ids"]
        assert choice["logprobs"] == one["logprobs"]
        for key in usage:
            usage[key] += ref["usage"][key]
    assert [c["message"]["content"] for c in body["choices"]] == [" yes no", " text done",
                                                                 " yes no"]
    assert {k: body["usage"][k] for k in usage} == usage


@pytest.mark.parametrize("fields, message", [
    ({"stream": True}, "stream"),
    ({"n": 2}, "n is not supported"),
    ({"echo": True}, "echo"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": [[{"role": "user", "content": "ask"}], []]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": "ask"}]}, "messages"),
    ({"messages": [[{"role": "user", "content": "ask"}]] * 4}, "--max-n"),
    ({"messages": [[{"role": "user", "content": "ask"}],
                   [{"role": "tool", "tool_call_id": "x", "content": "r"}]]},
     "conversation 1"),
])
def test_what_the_batch_route_refuses(server, fields, message):
    body = {"messages": [[{"role": "user", "content": "ask"}]], "max_tokens": 4} | fields
    r = _post(server, BATCH, body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
