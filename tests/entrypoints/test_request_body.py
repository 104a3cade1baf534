"""Request bodies read by request_body.py: what FastAPI would answer, large ones parsed and
validated in the front end's worker threads, and the models still in /openapi.json."""

from __future__ import annotations

import json
import threading
from typing import Any, ClassVar

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import field_validator

from pagedllm.entrypoints.openai import protocol_base
from pagedllm.entrypoints.openai.offload import INLINE_BYTES, Offloader
from pagedllm.entrypoints.openai.embedding_protocol import EmbeddingRequest
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, ChatMessage,
                                                  CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.score_protocol import (ClassifyRequest, RerankRequest,
                                                       ScoreRequest)
from pagedllm.entrypoints.openai.protocol_base import RequestModel
from pagedllm.entrypoints.openai.request_body import BodyRoutes
from pagedllm.entrypoints.openai.server import _install_error_handlers

# The server's request bodies.
BODY_MODELS = [CompletionRequest, ChatCompletionRequest, EmbeddingRequest, ResponsesRequest,
               ScoreRequest, ClassifyRequest, RerankRequest, TokenizeRequest,
               DetokenizeRequest]
JSON = {"content-type": "application/json"}
MESSAGE = {"role": "user", "content": "hi"}
# Enough messages that the body is read in a worker thread.
MANY = [MESSAGE] * (INLINE_BYTES // 20)


def _body(**fields: Any) -> bytes:
    return json.dumps({"messages": [MESSAGE]} | fields).encode()


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    _install_error_handlers(app)

    @app.post("/fastapi")
    async def by_fastapi(request: ChatCompletionRequest) -> dict:
        return {"messages": len(request.messages), "model": request.model}

    @BodyRoutes(app, Offloader(30.0)).post("/ours", body=ChatCompletionRequest)
    async def by_read_body(request: ChatCompletionRequest, _: Any) -> dict:
        return {"messages": len(request.messages), "model": request.model}

    with TestClient(app) as c:
        yield c


CASES = {
    "valid": (_body(model="m"), JSON),
    "valid, large": (json.dumps({"messages": MANY}).encode(), JSON),
    "valid, a +json media type": (_body(), {"content-type": "application/vnd.api+json"}),
    "valid, a charset parameter": (_body(), {"content-type": "application/json; charset=utf-8"}),
    "no body": (b"", JSON),
    "no Content-Type": (_body(), {}),
    "text/plain": (_body(), {"content-type": "text/plain"}),
    "invalid JSON": (b'{"messages": [', JSON),
    "invalid JSON, large": (b'{"messages": ' + json.dumps(MANY).encode()[:-1], JSON),
    "not UTF-8": (b'{"messages": [{"role": "user", "content": "\xff"}]}', JSON),
    "an integer of 5000 digits": (b'{"max_tokens": ' + b"9" * 5000 + b"}", JSON),
    "brackets 5000 deep": (b"[" * 5000 + b"]" * 5000, JSON),
    "a list": (b"[1, 2]", JSON),
    "null": (b"null", JSON),
    "an unknown field": (_body(frobnicate=1), JSON),
    "a bad message, large": (json.dumps({"messages": MANY + [{"role": 3}]}).encode(), JSON),
    "a lone surrogate, large": (
        json.dumps({"messages": MANY + [{"role": "user", "content": "a\ud800"}]}).encode(),
        JSON),
    "an unsupported value": (_body(audio={"voice": "alloy"}), JSON),
    "a validator's error": (_body(tool_choice="required"), JSON),
}


@pytest.mark.parametrize("case", list(CASES))
def test_read_body_answers_as_fastapi_does(client, case):
    content, headers = CASES[case]
    ours = client.post("/ours", content=content, headers=headers)
    fastapi = client.post("/fastapi", content=content, headers=headers)
    assert (ours.status_code, ours.json()) == (fastapi.status_code, fastapi.json())
    if case.startswith("valid"):
        assert ours.status_code == 200
    else:
        assert ours.status_code == 400 and ours.json()["error"]["message"]


class _Probe(RequestModel):
    """Records the thread its `text` is validated in."""

    text: str
    threads: ClassVar[list[str]] = []

    @field_validator("text")
    @classmethod
    def _record(cls, text: str) -> str:
        cls.threads.append(threading.current_thread().name)
        return text


def test_large_bodies_are_parsed_and_validated_in_a_worker_thread():
    app = FastAPI()

    @BodyRoutes(app, Offloader(30.0)).post("/probe", body=_Probe)
    async def probe(request: _Probe, _: Any) -> int:
        return len(request.text)

    with TestClient(app) as c:
        small = c.post("/probe", json={"text": "x" * 100})
        large = c.post("/probe", json={"text": "x" * INLINE_BYTES})
    assert (small.json(), large.json()) == (100, INLINE_BYTES)
    inline, offloaded = _Probe.threads
    assert not inline.startswith("pagedllm-front")
    assert offloaded.startswith("pagedllm-front")


def test_openapi_keeps_the_body_models(client):
    doc = client.get("/openapi.json").json()
    ours = doc["paths"]["/ours"]["post"]["requestBody"]
    assert ours == doc["paths"]["/fastapi"]["post"]["requestBody"]

    app = FastAPI()  # only routes of ours (the server's): the models come from BodyRoutes
    routes = BodyRoutes(app, Offloader(30.0))
    for i, model in enumerate(BODY_MODELS):
        routes.post(f"/{i}", body=model)(lambda request, _: None)
    with TestClient(app) as c:
        doc = c.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert {"messages", "tools", "response_format"} <= set(
        schemas["ChatCompletionRequest"]["properties"])
    for i, model in enumerate(BODY_MODELS):
        body = doc["paths"][f"/{i}"]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model.__name__}"}
    refs = set()
    stack: list[Any] = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.add(node["$ref"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    assert "#/components/schemas/ChatMessage" in refs
    for ref in refs:  # every reference resolves
        assert ref.removeprefix("#/components/schemas/") in schemas, ref


def test_a_body_is_walked_for_invalid_text_once(monkeypatch):
    calls = []
    walk = protocol_base.check_json_value
    monkeypatch.setattr(protocol_base, "check_json_value",
                        lambda value, *a: calls.append(1) or walk(value, *a))
    ChatCompletionRequest.model_validate({"messages": [MESSAGE] * 50})
    assert len(calls) == 1  # not once more for each message
    # A part validated alone is still checked.
    with pytest.raises(ValueError, match="content is not valid Unicode"):
        ChatMessage.model_validate({"role": "user", "content": "a\ud800"})
    with pytest.raises(ValueError, match=r"messages\[2\]\.content is not valid Unicode"):
        ChatCompletionRequest.model_validate(
            {"messages": [MESSAGE, MESSAGE, {"role": "user", "content": "a\ud800"}]})
