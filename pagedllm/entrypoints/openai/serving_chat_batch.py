"""POST /v1/chat/completions/batch (vLLM's): several conversations in one request, each
checked, rendered and run by the chat handler as its own chat request (engine ids
`{id}-{i}-0`, all in flight together), answered as one chat.completion whose choice i
is conversation i's reply and whose usage adds theirs up. At most --max-n
conversations; not streamed."""

from __future__ import annotations

from pagedllm.entrypoints.openai.protocol import (BatchChatCompletionRequest,
                                                  ChatCompletionResponse,
                                                  ChatCompletionResponseChoice, random_id)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_common import logprobs_bytes, merge_streams
from pagedllm.errors import InvalidRequestError
from pagedllm.outputs import RequestOutput


async def create_batch_chat_completion(chat: OpenAIServingChat,
                                       request: BatchChatCompletionRequest) -> object:
    limit = chat.serve_config.max_n
    if len(request.messages) > limit:
        raise InvalidRequestError(f"{len(request.messages)} conversations are more than the "
                                  f"{limit} one request may hold (--max-n)")
    conversations = [request.conversation(i) for i in range(len(request.messages))]
    prepared = [await chat.prepare(c) for c in conversations]
    request_id = request.request_id or random_id("chatcmpl")
    streams: list = []
    try:
        for i, p in enumerate(prepared):
            streams += chat.add_requests(f"{request_id}-{i}", [(p.text, p.ids)], [p.params],
                                         request, images=p.images)
        finals: list[RequestOutput | None] = [None] * len(prepared)
        async for i, out in merge_streams(streams):
            finals[i] = out
    finally:
        for i in range(len(streams)):  # no-op unless cancelled or refused midway
            chat.abort_all(f"{request_id}-{i}", 1)
    choices = []
    for i, (conversation, p, final) in enumerate(zip(conversations, prepared, finals)):
        out = final.outputs[0]
        message, finish_reason = chat.message_of(out, chat.reasoning_reader(p.phase),
                                                 p.plan.new_reader())
        message.role = chat.reply_role(conversation)
        if not request.include_reasoning:
            message.reasoning = message.reasoning_content = None
        logprobs = (chat.chat_logprobs(out.token_ids, out.logprobs, request.top,
                                       chat.tokens_as_ids(request))
                    if request.logprobs else None)
        ids = {"token_ids": list(out.token_ids)} if request.return_token_ids else {}
        choices.append(ChatCompletionResponseChoice(
            index=i, message=message, logprobs=logprobs, finish_reason=finish_reason,
            stop_reason=out.stop_reason, **ids))
    num_completion = sum(len(f.outputs[0].token_ids) for f in finals)
    usage = chat.usage(sum(len(f.prompt_token_ids) for f in finals), num_completion,
                       sum(f.num_cached_tokens or 0 for f in finals))
    size = logprobs_bytes(request.top_logprobs or 0 if request.logprobs else None,
                          num_completion)

    def build() -> ChatCompletionResponse:
        return ChatCompletionResponse(id=request_id, model=chat.response_model(request.model),
                                      choices=choices, usage=usage)
    return await chat.json_response(build, size)
