"""POST /v1/responses driven by the `openai` client's Responses API: the same reply as the
chat API for the same conversation, streams whose events assemble to the non-streamed
response, structured output through text.format, reasoning items, function calls and
their outputs in a conversation (a scripted model writes known outputs), the 400s of
what a stateless server cannot do, and stored responses (--enable-responses-store):
previous_response_id, GET and DELETE."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.utils import MODEL_NAME, RemoteServer
from tests.utils import save_scripted_llama

CALL = ['<tool_call>', '{"name":', '"get_weather",', '"arguments":', '{"city":',
        '"Paris"}}', '</tool_call>']
# go -> <think> hmm well </think> <tool_call> ... </tool_call>; hi -> hello there.
SCRIPT = {"go": "<think>", "<think>": "hmm", "hmm": "well", "well": "</think>",
          "</think>": CALL[0], **dict(zip(CALL, CALL[1:])), "hi": "hello",
          "hello": "there", "sunny": "ok", "low": "brief", "high": "long"}
# A template that reads reasoning_effort when given: the reply follows its last word.
TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if reasoning_effort is defined %}{{ reasoning_effort }}{% endif %}")
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(["--dtype", "float32", "--max-model-len", "512",
                        "--num-kv-blocks", "128", "--max-num-seqs", "8"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = save_scripted_llama(tmp_path_factory.mktemp("scripted"), SCRIPT, TEMPLATE)
    srv = RemoteServer([str(path), "--dtype", "float32", "--max-model-len", "64",
                        "--num-kv-blocks", "64", "--served-model-name", "scripted",
                        "--reasoning-parser", "deepseek_r1",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--enable-responses-store"])
    yield srv
    srv.stop()


def _comparable(response) -> dict:
    """A response without what differs between two runs (ids, times)."""
    data = response.model_dump()
    data.pop("id"), data.pop("created_at")
    data["usage"]["input_tokens_details"].pop("cached_tokens")  # a rerun hits the cache
    for item in data["output"]:
        item.pop("id", None)
        item.pop("parsed_arguments", None)  # the SDK's stream helper parses arguments
        for part in item.get("content") or []:
            part.pop("parsed", None)  # the SDK's stream helper parses output_text
    return data


def _streamed(client, **kwargs):
    """(event types, text deltas, final response) of a streamed response."""
    types, deltas, final = [], [], None
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.completed":
                final = event.response
        assert stream.get_final_response().id == final.id  # the SDK's helper works
    assert [int(n) for n in range(len(types))] == list(range(len(types)))
    return types, deltas, final


def test_same_reply_as_the_chat_api(server):
    client = server.openai_client()
    r = client.responses.create(model=MODEL_NAME, instructions="You answer briefly.",
                                input="What is the capital of France?",
                                max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "You answer briefly."},
                  {"role": "user", "content": "What is the capital of France?"}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"]
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens == 12
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "You answer briefly." and r.max_output_tokens == 12
    types, deltas, final = _streamed(client, model=MODEL_NAME,
                                     instructions="You answer briefly.",
                                     input="What is the capital of France?",
                                     max_output_tokens=12, temperature=0)
    assert "".join(deltas) == r.output_text
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert _comparable(final) == _comparable(r)


def test_text_format_json_schema(server):
    client = server.openai_client()
    r = client.responses.create(
        model=MODEL_NAME, input="Is Paris in France? Answer in JSON.", temperature=0,
        max_output_tokens=32, text={"format": {"type": "json_schema", "name": "yes_no",
                                               "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


LOGPROBS = ["message.output_text.logprobs"]


def _streamed_logprobs(client, **kwargs):
    """(the logprobs the text deltas carried, those of output_text.done, the final
    response) of a streamed response."""
    deltas, done, final = [], None, None
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas += event.logprobs
            elif event.type == "response.output_text.done":
                done = event.logprobs
            elif event.type == "response.completed":
                final = event.response
    return deltas, done, final


def test_output_text_logprobs(server):
    """include ["message.output_text.logprobs"]: the chat API's logprobs of the same
    reply (top_logprobs alternatives each), streamed with the text deltas."""
    client = server.openai_client()
    kwargs = dict(model=MODEL_NAME, input="What is the capital of France?",
                  max_output_tokens=8, temperature=0)
    r = client.responses.create(include=LOGPROBS, top_logprobs=2, **kwargs)
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    logprobs = r.output[0].content[0].logprobs
    expected = chat.choices[0].logprobs.content
    assert len(logprobs) == len(expected) == r.usage.output_tokens == 8
    for got, want in zip(logprobs, expected):
        assert (got.token, got.bytes) == (want.token, want.bytes)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
        assert len(got.top_logprobs) == 2
    assert "".join(lp.token for lp in logprobs) == r.output_text
    deltas, done, final = _streamed_logprobs(client, include=LOGPROBS, top_logprobs=2,
                                             **kwargs)
    final_logprobs = final.output[0].content[0].logprobs
    assert [lp.model_dump() for lp in deltas] == [lp.model_dump() for lp in done] == [
        lp.model_dump() for lp in final_logprobs] == [lp.model_dump() for lp in logprobs]
    # Not asked: none (top_logprobs alone asks nothing, as OpenAI's).
    assert client.responses.create(top_logprobs=2, **kwargs).output[0].content[0].logprobs == []
    # 20 alternatives: built and serialized in a worker thread (past INLINE_BYTES), the
    # same logprobs.
    wide = client.responses.create(include=LOGPROBS, top_logprobs=20, **kwargs)
    wide_logprobs = wide.output[0].content[0].logprobs
    assert [len(lp.top_logprobs) for lp in wide_logprobs] == [20] * 8
    assert [lp.model_dump() for lp in wide_logprobs][0]["top_logprobs"][:2] == [
        t.model_dump() for t in logprobs[0].top_logprobs]
    deltas, done, final = _streamed_logprobs(client, include=LOGPROBS, top_logprobs=20,
                                             **kwargs)
    assert [lp.model_dump() for lp in deltas] == [lp.model_dump() for lp in done] == [
        lp.model_dump() for lp in final.output[0].content[0].logprobs] == [
        lp.model_dump() for lp in wide_logprobs]


def test_output_text_logprobs_skip_the_reasoning(scripted):
    """The logprobs of a reply that reasons first are those of the tokens after its
    reasoning: <think> hmm well </think> then the text (no tools: the call is text)."""
    client = scripted.openai_client()
    kwargs = dict(model="scripted", input="go", temperature=0, max_output_tokens=20,
                  include=LOGPROBS, store=False)
    r = client.responses.create(**kwargs)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    logprobs = r.output[1].content[0].logprobs
    reasoning = r.usage.output_tokens_details.reasoning_tokens
    assert reasoning == 4 and len(logprobs) == r.usage.output_tokens - reasoning
    assert [lp.token.strip() for lp in logprobs] == [*CALL, "</s>"]
    assert all(lp.logprob == pytest.approx(0.0, abs=1e-3) for lp in logprobs)
    deltas, done, final = _streamed_logprobs(client, **kwargs)
    assert ([lp.token for lp in deltas] == [lp.token for lp in done]
            == [lp.token for lp in final.output[1].content[0].logprobs]
            == [lp.token for lp in logprobs])
    # Stored (past INLINE_BYTES: measured and sent from a worker thread): GET gives the
    # same response, and a response continues it.
    for stream in (False, True):
        body = kwargs | {"store": True, "top_logprobs": 15}  # of its ~20 words
        stored = (_streamed_logprobs(client, **body)[2] if stream
                  else client.responses.create(**body))
        assert _comparable(client.responses.retrieve(stored.id)) == _comparable(stored)
        assert len(stored.output[1].content[0].logprobs[0].top_logprobs) == 15
    followed = client.responses.create(model="scripted", temperature=0,
                                       input="x </think> hi", previous_response_id=stored.id)
    assert followed.output_text.split() == ["hello", "there"]


def test_truncation_auto_drops_the_oldest_turns(scripted):
    """truncation "auto": a conversation too long for the context (64 tokens here) loses
    its oldest user turns, as few as needed: the reply and input tokens of the
    conversation from the first turn that fits, sent as it is; without it, a 400."""
    client = scripted.openai_client()
    turns = [{"role": "user", "content": "hi " * 9}, {"role": "assistant", "content": "ok"}]
    conversation = turns * 6 + [{"role": "user", "content": "x </think> hi"}]
    kwargs = dict(model="scripted", temperature=0, max_output_tokens=8, store=False)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(input=conversation, **kwargs)
    cut = client.responses.create(input=conversation, truncation="auto", **kwargs)
    assert cut.truncation == "auto" and cut.output_text.split() == ["hello", "there"]
    starts = range(0, len(conversation), 2)
    fitting = []
    for start in starts:
        try:
            fitting.append(client.responses.create(input=conversation[start:], **kwargs))
        except openai.BadRequestError:
            assert not fitting  # once one fits, every shorter one does
    assert 0 < len(fitting) < len(starts)
    assert cut.usage.input_tokens == fitting[0].usage.input_tokens
    # The last turn alone too long: still the 400.
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(input=conversation[:-1] + [
            {"role": "user", "content": "hi " * 70}], truncation="auto", **kwargs)


@pytest.mark.parametrize("fields,fragment", [
    ({"previous_response_id": "resp_1"},
     "previous_response_id needs the server's response store, which is off: start it "
     "with --enable-responses-store"),
    ({"store": True}, "store: true needs the server's response store"),
    ({"include": ["reasoning.encrypted_content"]},
     "`include` 'reasoning.encrypted_content' is not supported by this server (only "
     "'message.output_text.logprobs')"),
    ({"include": LOGPROBS, "top_logprobs": 21}, "top_logprobs"),
    ({"reasoning": {"summary": "concise"}}, "reasoning.summary 'concise' is not supported"),
    ({"truncation": "middle"}, "truncation"),
    ({"background": True}, "background: true needs the server's response store"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input"),
    # A text model takes no images (a multimodal one does: test_llava_server.py).
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "only text content parts are supported by this model, got 'image_url'"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "must answer a call"),
    ({"input": []}, "input has no message"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "nope"}, "nope"),
])
def test_what_cannot_be_done_is_a_4xx(server, fields, fragment):
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 4} | fields
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert 400 <= r.status_code < 500 and fragment in r.json()["error"]["message"], r.text


def test_reasoning_and_function_calls(scripted):
    client = scripted.openai_client()
    r = client.responses.create(model="scripted", input="go", tools=[WEATHER],
                                temperature=0, max_output_tokens=20)
    assert r.status == "completed"
    assert [item.type for item in r.output] == ["reasoning", "function_call"]
    reasoning, call = r.output
    assert reasoning.content[0].text.split() == ["hmm", "well"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert r.usage.output_tokens_details.reasoning_tokens == 4  # <think> hmm well </think>
    types, deltas, final = _streamed(client, model="scripted", input="go", tools=[WEATHER],
                                     temperature=0, max_output_tokens=20)
    assert "response.reasoning_text.delta" in types and deltas == []
    assert types.count("response.function_call_arguments.done") == 1
    final_data, r_data = _comparable(final), _comparable(r)
    for data in (final_data, r_data):  # generated per response
        data["output"][1].pop("call_id")
    assert final_data == r_data


def test_a_conversation_with_calls_and_outputs(scripted):
    """The model's reasoning and call sent back, the call's output, a new user turn: a
    valid chat conversation (tool message after its call) whose reply is plain text
    (the prompt closed the reasoning)."""
    client = scripted.openai_client()
    r = client.responses.create(model="scripted", temperature=0, tools=[WEATHER], input=[
        {"role": "user", "content": "go"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm well"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "user", "content": [{"type": "input_text", "text": "x </think> hi"}]}])
    assert r.status == "completed" and [item.type for item in r.output] == ["message"]
    assert r.output_text.split() == ["hello", "there"]
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # The usual client loop: the previous response's output items (SDK objects) sent
    # back as they are, with the call's output.
    first = client.responses.create(model="scripted", input="go", tools=[WEATHER],
                                    temperature=0)
    call = first.output[-1]
    again = client.responses.create(model="scripted", temperature=0, tools=[WEATHER], input=[
        {"role": "user", "content": "go"}, *first.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        {"role": "user", "content": "x </think> hi"}])
    assert again.output_text.split() == ["hello", "there"]
    cut = client.responses.create(model="scripted", input="x </think> hi",
                                  max_output_tokens=1, temperature=0)
    assert cut.status == "incomplete" and cut.output[0].status == "incomplete"
    assert cut.output_text.split() == ["hello"]


def test_stored_responses_continue_conversations(scripted):
    """With --enable-responses-store a response is kept (OpenAI's default store: true):
    previous_response_id continues its conversation, which gives the reply the whole
    conversation sent again gives; GET returns it, DELETE forgets it."""
    client = scripted.openai_client()
    first = client.responses.create(model="scripted", input="go", tools=[WEATHER],
                                    temperature=0)
    assert first.store and first.previous_response_id is None
    assert _comparable(client.responses.retrieve(first.id)) == _comparable(first)
    call = first.output[-1]
    turn = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
            {"role": "user", "content": "x </think> hi"}]
    followed = client.responses.create(model="scripted", temperature=0, tools=[WEATHER],
                                       previous_response_id=first.id, input=turn)
    assert followed.previous_response_id == first.id
    whole = client.responses.create(model="scripted", temperature=0, tools=[WEATHER],
                                    store=False,
                                    input=[{"role": "user", "content": "go"}, *first.output,
                                           *turn])
    assert followed.output_text.split() == whole.output_text.split() == ["hello", "there"]
    assert followed.usage.input_tokens == whole.usage.input_tokens
    assert not whole.store
    with pytest.raises(openai.NotFoundError):  # store: false kept nothing
        client.responses.retrieve(whole.id)
    # A chain: the conversation of `followed` (first's input and output, then its own)
    # goes on; a streamed response is stored as it completes.
    _, _, streamed = _streamed(client, model="scripted", temperature=0,
                               previous_response_id=followed.id, input="hi")
    assert _comparable(client.responses.retrieve(streamed.id)) == _comparable(streamed)
    assert client.responses.retrieve(followed.id).output_text == followed.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model="scripted", input="hi", previous_response_id=first.id)
    # The responses that continued it keep their own copy of the conversation.
    again = client.responses.create(model="scripted", temperature=0, tools=[WEATHER],
                                    previous_response_id=followed.id,
                                    input="hi")
    assert again.status == "completed"
    r = httpx.delete(f"{scripted.url}/v1/responses/resp_nope", timeout=10)
    assert r.status_code == 404 and "resp_nope" in r.json()["error"]["message"]


def test_input_items_of_a_stored_response(scripted):
    """GET /v1/responses/{id}/input_items (client.responses.input_items.list): the items
    a response was generated from (the conversation it continued, then its own input),
    newest first by default, paged by item id; items sent without an id got one."""
    client = scripted.openai_client()
    first = client.responses.create(model="scripted", input="go", tools=[WEATHER],
                                    temperature=0)
    call = first.output[-1]
    turn = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
            {"role": "user", "content": [{"type": "input_text", "text": "x </think> hi"}]}]
    followed = client.responses.create(model="scripted", temperature=0, tools=[WEATHER],
                                       previous_response_id=first.id, input=turn)
    listed = client.responses.input_items.list(followed.id, order="asc", limit=100)
    items = [item.model_dump() for item in listed.data]
    # "go", first's output items (their ids kept), then the turn.
    assert [i["type"] for i in items] == ["message", *[o.type for o in first.output],
                                          "function_call_output", "message"]
    assert items[0]["role"] == "user"
    assert [(p["type"], p["text"]) for p in items[0]["content"]] == [("input_text", "go")]
    assert [i["id"] for i in items[1:-2]] == [o.id for o in first.output]
    assert items[-2]["output"] == "sunny" and items[-2]["id"].startswith("fco_")
    assert items[-1]["content"][0]["text"] == "x </think> hi"
    assert items[0]["id"].startswith("msg_") and items[-1]["id"].startswith("msg_")
    assert not listed.has_more and listed.first_id == items[0]["id"]
    # Newest first by default; one at a time, the cursor walks the same items.
    newest = client.responses.input_items.list(followed.id)
    assert [i.id for i in newest.data] == [i["id"] for i in reversed(items)]
    walked, after = [], None
    while True:
        page = httpx.get(f"{scripted.url}/v1/responses/{followed.id}/input_items",
                         params={"limit": 1, **({"after": after} if after else {})},
                         timeout=10).json()
        walked += [i["id"] for i in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert walked == [i.id for i in newest.data]
    before = httpx.get(f"{scripted.url}/v1/responses/{followed.id}/input_items",
                       params={"order": "asc", "before": items[2]["id"]}, timeout=10).json()
    assert [i["id"] for i in before["data"]] == [items[0]["id"], items[1]["id"]]
    # The ids are stored: the same on every call.
    again = client.responses.input_items.list(followed.id, order="asc", limit=100)
    assert [i.id for i in again.data] == [i["id"] for i in items]
    for params, fragment in (({"limit": 0}, "limit must be between 1 and 100"),
                             ({"order": "up"}, "order must be 'asc' or 'desc'"),
                             ({"after": "msg_nope"}, "after: no input item 'msg_nope'")):
        r = httpx.get(f"{scripted.url}/v1/responses/{followed.id}/input_items",
                      params=params, timeout=10)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    r = httpx.get(f"{scripted.url}/v1/responses/resp_nope/input_items", timeout=10)
    assert r.status_code == 404


def test_reasoning_effort_reaches_the_template(scripted):
    """Chat's reasoning_effort and Responses' reasoning.effort are the template's
    `reasoning_effort` (chat_template_kwargs win); a summary other than "auto" is a 400
    (none is written)."""
    client = scripted.openai_client()
    hi = [{"role": "user", "content": "x </think> hi"}]

    def chat(**kwargs) -> str:
        return client.chat.completions.create(model="scripted", messages=hi, temperature=0,
                                              **kwargs).choices[0].message.content.strip()

    assert chat() == "hello there"
    assert chat(reasoning_effort="low") == "brief"
    assert chat(reasoning_effort="low",
                extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}) == "long"
    response = client.responses.create(model="scripted", input=hi, temperature=0,
                                       reasoning={"effort": "low", "summary": "auto"})
    assert response.output_text.strip() == "brief"
    assert response.reasoning.effort == "low" and response.reasoning.summary == "auto"
    plain = client.responses.create(model="scripted", input=hi, temperature=0)
    assert plain.output_text.strip() == "hello there" and plain.reasoning is None
    for body, fragment in (({"reasoning": {"summary": "detailed"}},
                            "reasoning.summary 'detailed' is not supported"),
                           ({"reasoning": {"effort": "huge"}}, "reasoning.effort")):
        r = httpx.post(f"{scripted.url}/v1/responses", timeout=30,
                       json={"model": "scripted", "input": "hi"} | body)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    r = httpx.post(f"{scripted.url}/v1/chat/completions", timeout=30, json={
        "model": "scripted", "messages": hi, "reasoning_effort": "maximal"})
    assert r.status_code == 400 and "reasoning_effort" in r.json()["error"]["message"]
