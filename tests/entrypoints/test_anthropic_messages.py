"""Anthropic's Messages API (pagedllm/entrypoints/anthropic/), driven by Anthropic's own
SDK. The reference for every reply is /v1/chat/completions on the same conversation:
the same engine and template, so the same text, tool calls and token counts, whatever
shape they come back in."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.entrypoints.utils import MODEL_NAME, RemoteServer
from tests.utils import save_scripted_llama

KEY = "sk-anthropic-test"
SYSTEM = "You are a terse assistant."
WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(["--max-model-len", "512", "--num-kv-blocks", "256",
                        "--max-num-seqs", "8", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes"], api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _chat(server: RemoteServer, messages: list[dict], **fields) -> dict:
    body = {"messages": messages, "temperature": 0} | fields
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers,
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _post(server: RemoteServer, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120,
                      headers={"x-api-key": KEY, **headers})


def _events(server: RemoteServer, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a raw stream; each data's `type` is its event's name."""
    out, name = [], None
    with httpx.stream("POST", server.url + "/v1/messages", json=dict(body, stream=True),
                      headers={"x-api-key": KEY}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                out.append((name, data))
    return out


def _blocks(message) -> list[dict]:
    return [{k: v for k, v in b.model_dump().items()
             if k in ("type", "text", "thinking", "signature", "name", "input")}
            for b in message.content]


def test_reply_is_the_chat_reply(server, client):
    messages = [{"role": "user", "content": "Name three fruits."}]
    msg = client.messages.create(model=MODEL_NAME, max_tokens=24, system=SYSTEM,
                                 messages=messages, **GREEDY)
    ref = _chat(server, [{"role": "system", "content": SYSTEM}, *messages], max_tokens=24)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL_NAME
    assert msg.id.startswith("msg_")
    [block] = msg.content
    assert block.type == "text" and block.text == ref["choices"][0]["message"]["content"]
    finish = ref["choices"][0]["finish_reason"]
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert msg.stop_sequence is None
    # Anthropic's counts: input_tokens leaves out what the prefix cache held and what
    # this request wrote to it (its prompt's full blocks of 16 beyond the hits).
    usage = msg.usage
    total = ref["usage"]["prompt_tokens"]
    assert usage.input_tokens + usage.cache_read_input_tokens + (
        usage.cache_creation_input_tokens) == total
    assert usage.cache_read_input_tokens + usage.cache_creation_input_tokens == (
        total // 16 * 16)
    assert usage.output_tokens == ref["usage"]["completion_tokens"]
    count = client.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=messages)
    assert count.input_tokens == ref["usage"]["prompt_tokens"]
    # The same request again: its prompt's full blocks come from the cache.
    again = client.messages.create(model=MODEL_NAME, max_tokens=24, system=SYSTEM,
                                   messages=messages, **GREEDY)
    assert again.content[0].text == block.text
    assert again.usage.cache_read_input_tokens >= 16
    assert again.usage.cache_creation_input_tokens == (
        total // 16 * 16 - again.usage.cache_read_input_tokens)


def test_stream_assembles_to_the_message(server, client):
    body = dict(model=MODEL_NAME, max_tokens=20, system=SYSTEM,
                messages=[{"role": "user", "content": "Say hello to Ada."}], **GREEDY)
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) > 1 and "".join(texts) == whole.content[0].text
    assert _blocks(final) == _blocks(whole)
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, 20)
    events = _events(server, {"model": MODEL_NAME, "max_tokens": 20, "temperature": 0,
                              "system": SYSTEM, "messages": body["messages"]})
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 20


def test_stop_sequence(server, client):
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    msg = client.messages.create(model=MODEL_NAME, max_tokens=40, messages=messages,
                                 stop_sequences=["5"], **GREEDY)
    ref = _chat(server, messages, max_tokens=40, stop=["5"])["choices"][0]
    assert ref["stop_reason"] == "5"  # the model does reach it
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "5"
    assert msg.content[0].text == ref["message"]["content"]
    with client.messages.stream(model=MODEL_NAME, max_tokens=40, messages=messages,
                                stop_sequences=["5"], **GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "5")


def test_prefill_continues_the_assistant_message(server, client):
    messages = [{"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": "My favourite color is"}]
    msg = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=messages,
                                 **GREEDY)
    ref = _chat(server, messages, max_tokens=12, add_generation_prompt=False,
                continue_final_message=True)
    assert msg.content[0].text == ref["choices"][0]["message"]["content"]
    assert not msg.content[0].text.startswith("My favourite")


def test_forced_tool_use_and_its_result(server, client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, chat_choice in (
            ({"type": "tool", "name": "get_weather"},
             {"type": "function", "function": {"name": "get_weather"}}),
            ({"type": "any", "disable_parallel_tool_use": True}, "required")):
        msg = client.messages.create(model=MODEL_NAME, max_tokens=60, messages=messages,
                                     tools=[WEATHER], tool_choice=choice, **GREEDY)
        tool = {"type": "function", "function": {
            "name": WEATHER["name"], "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}
        ref = _chat(server, messages, max_tokens=60, tools=[tool], tool_choice=chat_choice,
                    parallel_tool_calls=choice["type"] != "any")["choices"][0]
        [call] = ref["message"]["tool_calls"]
        [block] = msg.content
        assert msg.stop_reason == "tool_use"
        assert (block.type, block.name) == ("tool_use", "get_weather")
        assert block.input == json.loads(call["function"]["arguments"])
        assert isinstance(block.input.get("city"), str)
        with client.messages.stream(model=MODEL_NAME, max_tokens=60, messages=messages,
                                    tools=[WEATHER], tool_choice=choice, **GREEDY) as stream:
            final = stream.get_final_message()
        assert _blocks(final) == _blocks(msg) and final.stop_reason == "tool_use"
    # The call's result sent back: the conversation the chat API runs for the same turn.
    turn = messages + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": block.id,
                                           "name": block.name, "input": block.input}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": "Sunny, 21 C"},
            {"type": "text", "text": "Answer in one sentence."}]}]
    msg = client.messages.create(model=MODEL_NAME, max_tokens=24, messages=turn,
                                 tools=[WEATHER], tool_choice={"type": "none"}, **GREEDY)
    ref = _chat(server, messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input)}}]},
        {"role": "tool", "tool_call_id": block.id, "content": "Sunny, 21 C"},
        {"role": "user", "content": "Answer in one sentence."}],
        max_tokens=24, tools=[tool], tool_choice="none")
    assert msg.content[0].text == ref["choices"][0]["message"]["content"]
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens + (
        msg.usage.cache_creation_input_tokens) == ref["usage"]["prompt_tokens"]


def test_max_tokens_zero_fills_the_prefix_cache(server, client):
    messages = [{"role": "user", "content": "A question about the history of Rome, "
                                            "with many words to fill a few blocks: " * 3}]
    salted = {"cache_salt": "warm-up-test"}  # no other request's blocks
    warm = client.messages.create(model=MODEL_NAME, max_tokens=0, messages=messages,
                                  extra_body=salted)
    assert warm.content == [] and warm.stop_reason == "max_tokens"
    assert warm.usage.output_tokens == 0 and warm.usage.cache_read_input_tokens == 0
    msg = client.messages.create(model=MODEL_NAME, max_tokens=4, messages=messages,
                                 extra_body=salted | {"temperature": 0})
    total = warm.usage.input_tokens + warm.usage.cache_creation_input_tokens
    assert warm.usage.cache_creation_input_tokens == total // 16 * 16 > 0
    assert msg.usage.cache_read_input_tokens == (total - 1) // 16 * 16 > 0
    events = _events(server, {"model": MODEL_NAME, "max_tokens": 0, "messages": messages})
    assert [n for n, _ in events] == ["message_start", "message_delta", "message_stop"]


def test_api_key_as_bearer_or_x_api_key(server):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user",
                                                                  "content": "hi"}]}
    assert _post(server, "/v1/messages", body).status_code == 200
    r = httpx.post(server.url + "/v1/messages", json=body, headers=server.headers,
                   timeout=60)
    assert r.status_code == 200
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL_NAME, max_tokens=2, messages=body["messages"])
    assert e.value.body["error"]["type"] == "authentication_error"
    # Other routes keep OpenAI's error body.
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 401 and "type" in r.json()["error"] and "object" in r.json()


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("fields, named", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "'document'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a",
                                                   "name": "f", "input": {}}]}]},
     "not allowed in a 'user' message"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": "nope"}]}]}, "nope"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": "no result"}]}, "t1"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "other"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}, "max_tokens": 100},
     "budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "budget_tokens"),
    ({"container": "c1"}, "container"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"max_tokens": 10 ** 6}, "maximum context length"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "image"),
])
def test_bad_requests_get_anthropic_errors(server, fields, named):
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": USER} | fields
    r = _post(server, "/v1/messages", body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert named in err["error"]["message"]


def test_unknown_model_and_bad_json(server, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/messages", content=b"{not json",
                   headers={"x-api-key": KEY, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = _post(server, "/v1/messages/count_tokens", {"model": MODEL_NAME, "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_accepted_client_fields(server, client):
    """What Anthropic's clients send that asks for nothing here: accepted."""
    msg = client.messages.create(
        model=MODEL_NAME, max_tokens=4, metadata={"user_id": "u-1"},
        service_tier="auto", cache_control={"type": "ephemeral"},
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral",
                                                                   "ttl": "1h"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi",
                                                "cache_control": {"type": "ephemeral"}}]}],
        **GREEDY)
    assert msg.usage.output_tokens == 4


# ------------------------------------------------------------------ thinking and auto tools

CALL = ['<tool_call>', '{"name":', '"get_weather",', '"arguments":', '{"city":',
        '"Paris"}}', '</tool_call>']
# go -> <think> hmm well </think> <tool_call> ... </tool_call>; plain -> text done.
SCRIPT = {"go": "<think>", "<think>": "hmm", "hmm": "well", "well": "</think>",
          "</think>": CALL[0], **dict(zip(CALL, CALL[1:])), "plain": "text",
          "text": "done"}
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = save_scripted_llama(tmp_path_factory.mktemp("scripted"), SCRIPT, TEMPLATE)
    srv = RemoteServer([str(path), "--dtype", "float32", "--max-model-len", "64",
                        "--num-kv-blocks", "64", "--reasoning-parser", "deepseek_r1",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--served-model-name", "scripted"])
    yield srv
    srv.stop()


def test_thinking_and_auto_tool_use(scripted):
    client = anthropic.Anthropic(base_url=scripted.url, api_key="unused", max_retries=0)
    body = dict(model="scripted", max_tokens=16, tools=[WEATHER],
                messages=[{"role": "user", "content": "go"}], **GREEDY)
    msg = client.messages.create(**body)
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking.split() == ["hmm", "well"]
    assert msg.content[0].signature
    assert (msg.content[1].name, msg.content[1].input) == ("get_weather", {"city": "Paris"})
    assert msg.stop_reason == "tool_use"
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(msg) and final.stop_reason == "tool_use"
    # display "omitted": the thinking block keeps its signature, not its text.
    hidden = client.messages.create(**body, thinking={"type": "adaptive",
                                                      "display": "omitted"})
    assert hidden.content[0].thinking == ""
    assert hidden.content[0].signature == msg.content[0].signature
    with client.messages.stream(**body, thinking={"type": "adaptive",
                                                  "display": "omitted"}) as stream:
        assert _blocks(stream.get_final_message()) == _blocks(hidden)
    # The turn sent back (thinking and call included), the result last in the prompt:
    # the model writes on from "plain" (with no end tag, deepseek_r1 reads it all as
    # reasoning).
    reply = client.messages.create(model="scripted", max_tokens=4, tools=[WEATHER], messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                          for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": msg.content[1].id,
                                      "content": "plain"}]}], **GREEDY)
    assert [b.type for b in reply.content] == ["thinking"]
    assert reply.content[0].thinking.split()[:2] == ["text", "done"]


def test_thinking_token_budget(scripted, server):
    """thinking_token_budget on the OpenAI routes (vLLM's field) and Anthropic's
    budget_tokens mapped to it: the reasoning ends after that many tokens."""
    def post(path, body, srv=scripted):
        return httpx.post(srv.url + path, json=body, headers=srv.headers, timeout=120)

    chat = {"model": "scripted", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 16, "temperature": 0,
            "tools": [{"type": "function", "function": {
                "name": WEATHER["name"], "parameters": WEATHER["input_schema"]}}]}
    full = post("/v1/chat/completions", chat).json()["choices"][0]["message"]
    cut = post("/v1/chat/completions", chat | {"thinking_token_budget": 1}).json()
    cut = cut["choices"][0]["message"]
    assert (full["reasoning_content"].split(), cut["reasoning_content"].split()) == (
        ["hmm", "well"], ["hmm"])
    assert cut["tool_calls"][0]["function"]["name"] == "get_weather"
    r = post("/v1/completions", {"model": "scripted", "prompt": "go", "max_tokens": 4,
                                 "temperature": 0, "thinking_token_budget": 0})
    assert r.json()["choices"][0]["text"].split() == ["</think>", CALL[0], CALL[1], CALL[2]]
    # A prompt already past the budget (its reasoning opened and written): ended at once.
    r = post("/v1/completions", {"model": "scripted", "prompt": "go <think> hmm well",
                                 "max_tokens": 2, "temperature": 0, "thinking_token_budget": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].split() == [
        "</think>", CALL[0]]
    # Rendered for /inference/v1/generate, the budget comes along and holds there.
    body = post("/v1/chat/completions/render", chat | {"thinking_token_budget": 1}).json()
    assert body["sampling_params"]["thinking_token_budget"] == 1
    out = post("/inference/v1/generate", body | {"output_mode": "text"}).json()
    assert out["choices"][0]["text"] == post(
        "/v1/completions", {"model": "scripted", "prompt": body["token_ids"],
                            "max_tokens": 16, "temperature": 0,
                            "thinking_token_budget": 1}).json()["choices"][0]["text"]
    # Bad values, and a server without a reasoning parser: 400s naming the field.
    for bad in (-2, 1.5, True, "1"):
        r = post("/v1/chat/completions", chat | {"thinking_token_budget": bad})
        assert r.status_code == 400 and "thinking_token_budget" in r.text, (bad, r.text)
    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "thinking_token_budget": 5}, srv=server)
    assert r.status_code == 400 and "reasoning parser" in r.text
    # Anthropic's budget_tokens: the chat request's budget when the server reads
    # reasoning; on a server without a parser, thinking is only the template's switch.
    from pagedllm.entrypoints.anthropic.protocol import MessagesRequest

    msg = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 2048, "messages": [{"role": "user", "content": "go"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert msg.to_chat_request(True).thinking_token_budget == 1024
    assert msg.to_chat_request(False).thinking_token_budget is None
