"""vLLM's render routes: POST /v1/chat/completions/render, /v1/completions/render,
/v1/messages/render and /v1/responses/render. A request is checked and rendered exactly
as its own route would (chat template, tools, truncation, max_tokens from the context
left, structured-output constraints) and answered, without generating, with the body of
the Tokens In<>Out API (/inference/v1/generate) that runs it (the engine's own checks of
the request, which adding it would run, included): {request_id, token_ids,
sampling_params, model, stream, stream_options, cache_salt, priority}; a list of them
for a completion request with several prompts. A front end can render and route while
--tokens-only servers generate. What only a route's answer uses (chat's tool-call and
reasoning parsing, echo; a response's store and background) is not part of the body:
the caller reads the tokens.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from pagedllm.entrypoints.anthropic.protocol import MessagesRequest
from pagedllm.entrypoints.openai.generate_protocol import (GenerateRequest,
                                                           GenerateSamplingParams)
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  random_id)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, item_id
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import SamplingParams


# GenerateRequest's limit on request_id.
MAX_REQUEST_ID = GenerateRequest.model_fields["request_id"].metadata[0].max_length


class OpenAIServingRender:

    def __init__(self, chat: OpenAIServingChat, completions: OpenAIServingCompletion,
                 responses: OpenAIServingResponses) -> None:
        self.chat = chat
        self.completions = completions
        self.responses = responses

    async def render_chat(self, request: ChatCompletionRequest) -> dict[str, Any]:
        if request.echo:
            raise InvalidRequestError("echo is part of a chat answer, not of its prompt: "
                                      "it cannot be rendered")
        prepared = await self.chat.prepare(request)
        if prepared.images:
            raise InvalidRequestError("a conversation with images cannot be rendered: the "
                                      "Tokens In<>Out API takes no images")
        self.chat.check_requests([(prepared.text, prepared.ids)], [prepared.params], request)
        return _body(request, request.request_id or random_id("chatcmpl"), prepared.ids,
                     prepared.params)

    async def render_messages(self, request: MessagesRequest) -> dict[str, Any]:
        if request.max_tokens == 0:
            raise InvalidRequestError("max_tokens 0 (a prefix-cache warm-up) cannot be "
                                      "rendered: give at least 1")
        chat = request.to_chat_request(self.chat.reasoning is not None)
        chat.request_id = chat.request_id or f"msg_{uuid.uuid4().hex}"
        return await self.render_chat(chat)

    async def render_response(self, request: ResponsesRequest) -> dict[str, Any]:
        """The conversation it continues (previous_response_id, stored) and its input,
        rendered and truncated as /v1/responses would."""
        _, chat, prepared = await self.responses.prepare_response(request)
        if prepared.images:
            raise InvalidRequestError("a conversation with images cannot be rendered: the "
                                      "Tokens In<>Out API takes no images")
        self.responses.check_requests([(prepared.text, prepared.ids)], [prepared.params],
                                      chat)
        return _body(chat, item_id("resp"), prepared.ids, prepared.params)

    async def render_completion(self, request: CompletionRequest) -> list[dict[str, Any]]:
        if request.echo:
            raise InvalidRequestError("echo is part of a completion answer, not of its "
                                      "prompt: it cannot be rendered")
        prompts, embeds, params = await self.completions.prepare(request)
        if embeds is not None:
            raise InvalidRequestError("prompt_embeds cannot be rendered: the Tokens In<>Out "
                                      "API takes token ids")
        self.completions.check_requests(prompts, params, request)
        base = request.request_id or random_id("cmpl")
        return [_body(request, base if len(prompts) == 1 else f"{base}-{i}", ids, p)
                for i, ((_, ids), p) in enumerate(zip(prompts, params))]


def _body(request: ChatCompletionRequest | CompletionRequest, request_id: str,
          ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """The /inference/v1/generate body of one prepared prompt."""
    if len(request_id) > MAX_REQUEST_ID:
        raise InvalidRequestError(f"request_id: at most {MAX_REQUEST_ID} characters to be "
                                  f"rendered (the generate route's limit), got "
                                  f"{len(request_id)}")
    body: dict[str, Any] = {"request_id": request_id, "token_ids": list(ids),
                            "sampling_params": sampling_params_body(params),
                            "model": request.model, "stream": request.stream,
                            "cache_salt": request.cache_salt, "priority": request.priority}
    if request.stream and request.stream_options is not None:
        body["stream_options"] = request.stream_options.model_dump()
    return body


def sampling_params_body(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as vLLM's JSON fields (GenerateSamplingParams reads them back)."""
    body: dict[str, Any] = {}
    for name in GenerateSamplingParams.model_fields:
        if name == "output_kind":  # the generate route's own choice (streamed or not)
            continue
        value = getattr(params, name)
        if name == "structured_outputs" and value is not None:
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                     if f.init and getattr(value, f.name) != f.default}
        elif name == "logit_bias" and value is not None:
            value = {str(token): bias for token, bias in value.items()}
        elif name == "truncate_prompt_tokens":
            value = None  # the token ids are truncated already
        body[name] = value
    return body
