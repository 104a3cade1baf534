"""Background responses (`background: true`, --enable-responses-store): answered at once
"queued", run on by the server, polled with GET; cancelled (POST .../cancel) or deleted
while running, which frees their engine request; failed with their error; bounded by
--max-background-responses."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.entrypoints.utils import MODEL_NAME, RemoteServer

# SmolLM2 repeats it past 600 tokens (seconds): long enough to act on it while it runs.
LONG = "Repeat the word 'hello' 400 times."


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(["--max-model-len", "768", "--num-kv-blocks", "128",
                        "--max-num-seqs", "4", "--enable-responses-store",
                        "--max-background-responses", "2"])
    yield srv
    srv.stop()


def _wait_finished(client, response_id: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        assert time.monotonic() < deadline, f"still {response.status}"
        time.sleep(0.1)


def _wait_engine_idle(server, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.stats()
        if stats["num_running"] == stats["num_waiting"] == 0:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_background_response_runs_on_and_is_polled(server):
    client = server.openai_client()
    kwargs = dict(model=MODEL_NAME, input="Name a colour.", max_output_tokens=12,
                  temperature=0)
    queued = client.responses.create(background=True, **kwargs)
    assert queued.status == "queued" and queued.background and queued.store
    assert queued.output == [] and queued.usage is None
    done = _wait_finished(client, queued.id)
    assert done.status in ("completed", "incomplete") and done.background
    assert done.created_at == queued.created_at
    # The same reply a request waiting for it gets.
    direct = client.responses.create(store=False, **kwargs)
    assert done.output_text == direct.output_text and done.output_text
    assert done.usage.output_tokens == direct.usage.output_tokens
    # A finished background response: cancelling it answers it as it is.
    assert client.responses.cancel(queued.id).status == done.status
    # Only a background response can be cancelled.
    with pytest.raises(openai.BadRequestError, match="not created with background"):
        client.responses.cancel(client.responses.create(**kwargs).id)


def test_cancel_and_delete_stop_a_running_response(server):
    client = server.openai_client()
    running = client.responses.create(model=MODEL_NAME, input=LONG, background=True,
                                      max_output_tokens=600, temperature=0)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.id == running.id
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"  # idempotent
    _wait_engine_idle(server)
    # Deleting a running one cancels it too; it is gone from the store.
    running = client.responses.create(model=MODEL_NAME, input=LONG, background=True,
                                      max_output_tokens=600, temperature=0)
    while client.responses.retrieve(running.id).status == "queued":
        time.sleep(0.02)
    client.responses.delete(running.id)
    _wait_engine_idle(server)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)


def test_background_responses_are_bounded(server):
    """--max-background-responses 2: a third running at once is a 503 (its client holds
    no connection, so nothing else would bound them)."""
    client = server.openai_client()
    ids = [client.responses.create(model=MODEL_NAME, input=LONG, background=True,
                                   max_output_tokens=600, temperature=0).id
           for _ in range(2)]
    r = httpx.post(f"{server.url}/v1/responses", timeout=30, json={
        "model": MODEL_NAME, "input": "Hi", "background": True, "max_output_tokens": 4})
    assert r.status_code == 503, r.text
    assert "--max-background-responses" in r.json()["error"]["message"]
    assert r.headers["retry-after"]
    for response_id in ids:
        assert client.responses.cancel(response_id).status == "cancelled"
    _wait_engine_idle(server)
    again = client.responses.create(model=MODEL_NAME, input="Hi", background=True,
                                    max_output_tokens=4)
    assert _wait_finished(client, again.id).status in ("completed", "incomplete")


def test_a_failed_background_response_keeps_its_error(server):
    """A background response past its deadline (vLLM's `timeout`) is stored "failed"
    with the error a waiting client would have got."""
    client = server.openai_client()
    queued = client.responses.create(model=MODEL_NAME, input=LONG, background=True,
                                     max_output_tokens=600, temperature=0,
                                     extra_body={"timeout": 0.3})
    failed = _wait_finished(client, queued.id)
    assert failed.status == "failed" and failed.output == []
    assert "timed out" in failed.error.message
    _wait_engine_idle(server)


def test_a_streamed_background_response_runs_on_when_its_client_leaves(server):
    """background with stream: the events go to the client (created "queued"), the same
    reply a plain stream gets; a client that leaves mid-stream leaves the response
    running, and it completes in the store."""
    client = server.openai_client()
    kwargs = dict(model=MODEL_NAME, input="Name a colour.", max_output_tokens=12,
                  temperature=0)
    events = list(client.responses.create(background=True, stream=True, **kwargs))
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    assert events[1].type == "response.in_progress"
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.background
    assert final.created_at == events[0].response.created_at
    assert final.output_text == client.responses.create(store=False, **kwargs).output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text
    # Leave after a few events of a long one: it runs on, and its tokens all come.
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60, json={
            "model": MODEL_NAME, "input": LONG, "background": True, "stream": True,
            "max_output_tokens": 200, "temperature": 0}) as r:
        lines = r.iter_lines()
        created = next(line for line in lines if line.startswith("data: "))
        response_id = json.loads(created.removeprefix("data: "))["response"]["id"]
        next(line for line in lines if "response.output_text.delta" in line)
    # Gone after its first token (of 200): the response is still running.
    assert client.responses.retrieve(response_id).status == "in_progress"
    done = _wait_finished(client, response_id)
    assert done.status == "incomplete" and done.usage.output_tokens == 200
    # Cancelled while its client listens: the stream ends, the store says so.
    stream = client.responses.create(model=MODEL_NAME, input=LONG, background=True,
                                     stream=True, max_output_tokens=600, temperature=0)
    first = next(iter(stream))
    assert client.responses.cancel(first.response.id).status == "cancelled"
    assert all(event.type != "response.completed" for event in stream)
    _wait_engine_idle(server)


def _sse(server, response_id: str, **params) -> list[dict]:
    with httpx.stream("GET", f"{server.url}/v1/responses/{response_id}", timeout=120,
                      params={"stream": "true", **params}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line.removeprefix("data: ")) for line in r.iter_lines()
                if line.startswith("data: ")]


def test_a_background_stream_is_read_again_from_any_event(server):
    """GET /v1/responses/{id}?stream=true&starting_after=N (OpenAI's resumable streams):
    while the response runs, the events after N and then the rest as they come; once
    it finished, the same events again. Only background streams keep theirs."""
    body = {"model": MODEL_NAME, "input": LONG, "background": True, "stream": True,
            "max_output_tokens": 60, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60, json=body) as r:
        lines = r.iter_lines()
        first = []
        for line in lines:
            if line.startswith("data: "):
                first.append(json.loads(line.removeprefix("data: ")))
                if len(first) == 4:
                    break  # the client leaves after four events
    response_id = first[0]["response"]["id"]
    # Resumed while it runs: from event 4 on, live, to its end.
    rest = _sse(server, response_id, starting_after=3)
    events = first + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    done = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    stored = server.openai_client().responses.retrieve(response_id)
    assert stored.status == done["status"] and stored.output_text == text
    # Finished: the whole stream again, or its tail.
    assert _sse(server, response_id) == events
    assert _sse(server, response_id, starting_after=len(events) - 3) == events[-2:]
    # A response that was not a background stream has none.
    client = server.openai_client()
    plain = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    r = httpx.get(f"{server.url}/v1/responses/{plain.id}", params={"stream": "true"})
    assert r.status_code == 400 and "has no stream to read again" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/responses/{response_id}",
                  params={"stream": "true", "starting_after": -5})
    assert r.status_code == 400 and "starting_after" in r.json()["error"]["message"]
    client.responses.delete(response_id)
    r = httpx.get(f"{server.url}/v1/responses/{response_id}", params={"stream": "true"})
    assert r.status_code == 404


def test_background_without_store_is_a_400(server):
    body = {"model": MODEL_NAME, "input": "Hi", "background": True, "store": False}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "background: true needs store: true" in r.json()["error"]["message"]
