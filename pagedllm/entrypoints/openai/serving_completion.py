"""POST /v1/completions: prompts as text, token ids, or lists of either (or as input
embeddings, prompt_embeds); n, best_of, echo, logprobs, stop, seed, streaming with
usage."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from pagedllm.entrypoints.openai.protocol import (CompletionLogprobs, CompletionRequest,
                                                  CompletionResponse,
                                                  CompletionResponseChoice,
                                                  prompt_logprobs_field, random_id)
from pagedllm.entrypoints.openai.serving_common import (OpenAIServing, SSEResponse,
                                                        clamp_logprob, logprobs_bytes,
                                                        merge_streams,
                                                        prompt_logprobs_bytes, sse,
                                                        sse_error)
from pagedllm.engine.prompt_embeds import (PLACEHOLDER_ID, check_embeds,
                                           decode_prompt_embeds, embeds_input)
from pagedllm.errors import InvalidRequestError
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

Prompt = tuple[str | None, list[int]]  # (text or None, token ids)


@dataclass
class _ChoiceState:
    """What a stream has sent of one choice so far."""

    num_chars: int = 0
    num_tokens: int = 0
    is_finished: bool = False
    # Characters before this choice's next token (logprobs text_offset).
    offset: int = 0


@dataclass
class _StreamState:
    choices: dict[int, _ChoiceState] = field(default_factory=dict)
    num_prompt_tokens: dict[int, int] = field(default_factory=dict)
    num_cached_tokens: dict[int, int] = field(default_factory=dict)
    # Each prompt's latest output (its timestamps).
    latest: dict[int, RequestOutput] = field(default_factory=dict)


class OpenAIServingCompletion(OpenAIServing):

    async def create_completion(self, request: CompletionRequest,
                                ) -> CompletionResponse | Response | SSEResponse:
        prompts, embeds, params = await self.prepare(request)
        request_id = request.request_id or random_id("cmpl")
        streams = self.add_requests(request_id, prompts, params, request, embeds=embeds)
        if request.stream:
            return SSEResponse(self._stream(request, request_id, prompts, streams),
                               self.serve_config.sse_keep_alive_interval)
        try:
            finals: list[RequestOutput | None] = [None] * len(prompts)
            async for i, out in merge_streams(streams):
                finals[i] = out
        finally:
            self.abort_all(request_id, len(prompts))  # no-op unless cancelled
        num_prompt_tokens = sum(len(ids) for _, ids in prompts)
        num_tokens = sum(len(o.token_ids) for ro in finals for o in ro.outputs)
        size = (prompt_logprobs_bytes(request.prompt_logprobs, request.n, num_prompt_tokens)
                + logprobs_bytes(request.logprobs,
                                 num_tokens + request.echo * request.n * num_prompt_tokens))
        envelope, choices = self._response(request, request_id, prompts, finals)
        return await self.choices_response(envelope, choices, size)

    async def prepare(self, request: CompletionRequest,
                      ) -> tuple[list[Prompt], list[Any] | None, list[SamplingParams]]:
        """Check a completion request and read its prompts: (text, ids) each, the
        tensors of a prompt_embeds request, and each prompt's SamplingParams (400s for
        what is wrong)."""
        self.check_model(request.model)
        self.check_generation()
        if request.suffix is not None:
            raise InvalidRequestError("suffix is not currently supported")
        if request.logprobs is not None and request.logprobs < 0:
            raise InvalidRequestError(f"logprobs must be non-negative, got {request.logprobs}")
        self.check_limits(request, request.logprobs)
        if request.max_tokens == 0 and not request.echo:
            raise InvalidRequestError("max_tokens must be at least 1 (0 only with echo, to "
                                      "score the prompt), got 0.")
        prompts, embeds = await self._parse_prompts(request)
        kwargs = request.sampling_kwargs()
        if request.echo and request.logprobs is not None and request.prompt_logprobs is None:
            # The echoed prompt's logprobs (vLLM: prompt_logprobs, when given, wins).
            kwargs["prompt_logprobs"] = request.logprobs
        # echo with max_tokens 0 scores the prompt: the engine samples one token, which
        # the response leaves out (vLLM does the same).
        requested = 1 if _is_echo_only(request) else request.max_tokens
        await self.read_constraint(kwargs)
        params = []
        for _, ids in prompts:
            max_tokens = self.check_length(len(ids), requested, kind="prompt")
            params.append(self.sampling_params(kwargs | {"max_tokens": max_tokens},
                                               request.stream,
                                               self.engine.config.model.sampling_defaults))
        await self.check_constraints(params[0])
        return prompts, embeds, params

    async def _parse_prompts(self, request: CompletionRequest,
                             ) -> tuple[list[Prompt], list[Any] | None]:
        """The prompts as (text, ids), and the tensors of a prompt_embeds request (its
        prompts' ids are then placeholders, one per row)."""
        if (request.prompt is None) == (request.prompt_embeds is None):
            raise InvalidRequestError("give exactly one of prompt or prompt_embeds")
        if request.prompt_embeds is not None:
            return await self._parse_embeds(request)
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty")
        self.check_n(len(prompt), request)
        prompts: list[Prompt] = []
        for p in prompt:
            if isinstance(p, str):
                ids = await self.encode(p, request.add_special_tokens)
                prompts.append(self.truncate(p, ids, request.truncate_prompt_tokens))
            else:
                prompts.append(self.truncate(None, list(p), request.truncate_prompt_tokens))
        return prompts, None

    async def _parse_embeds(self, request: CompletionRequest,
                            ) -> tuple[list[Prompt], list[Any]]:
        model = self.engine.config.model
        if not model.enable_prompt_embeds:
            raise InvalidRequestError("prompt_embeds needs the server started with "
                                      "--enable-prompt-embeds")
        if request.echo:
            raise InvalidRequestError("echo needs a prompt of tokens; this one is "
                                      "prompt_embeds")
        data = request.prompt_embeds
        data = [data] if isinstance(data, str) else data
        if not data:
            raise InvalidRequestError("prompt_embeds must not be empty")
        self.check_n(len(data), request)
        hidden_size = model.hf_config.get_text_config().hidden_size
        prompts, tensors = [], []
        for item in data:
            tensor = check_embeds(await self.offloader.run(
                "decoding prompt_embeds", len(item), decode_prompt_embeds, item), hidden_size)
            _, kept = self.truncate(None, [PLACEHOLDER_ID] * tensor.shape[0],
                                    request.truncate_prompt_tokens)
            prompts.append((None, kept))
            # Copied to float32, checked and hashed here, off the event loop when large:
            # the engine takes the result as it is.
            tensors.append(await self.offloader.run(
                "reading prompt_embeds", len(item), embeds_input,
                tensor[tensor.shape[0] - len(kept):]))
        return prompts, tensors

    def check_n(self, num_prompts: int, request: CompletionRequest) -> None:
        limit = self.serve_config.max_n
        if num_prompts * (request.best_of or request.n) > limit:
            raise InvalidRequestError(
                f"{num_prompts} prompts x {request.best_of or request.n} completions "
                f"each is more than the {limit} sequences one request may ask for "
                f"(--max-n).")

    # ------------------------------------------------------------------ full response

    def _response(self, request: CompletionRequest, request_id: str, prompts: list[Prompt],
                  finals: list[RequestOutput | None],
                  ) -> tuple[Callable[[], CompletionResponse],
                             list[Callable[[], CompletionResponseChoice]]]:
        """The response without its choices, and a builder of each choice."""
        choices = []
        num_prompt_tokens = num_completion_tokens = 0
        for i, ro in enumerate(finals):
            assert ro is not None, "every stream ends with a finished output"
            num_prompt_tokens += ro.num_prompt_tokens
            # The prompt's logprobs: converted once for its n choices, when first built.
            prompt_field = functools.cache(lambda ro=ro: prompt_logprobs_field(
                ro.prompt_logprobs) if request.prompt_logprobs is not None else None)
            for out in sorted(_visible(request, ro.outputs), key=lambda o: o.index):
                num_completion_tokens += len(out.token_ids)
                choices.append(functools.partial(self._choice, request, prompts[i], ro, out,
                                                 i * request.n + out.index, prompt_field))
        usage = self.usage(num_prompt_tokens, num_completion_tokens,
                           sum(ro.num_cached_tokens for ro in finals))
        metrics = self.timing(finals, num_completion_tokens)

        def envelope() -> CompletionResponse:
            return CompletionResponse(id=request_id, model=self.response_model(request.model),
                                      choices=[], usage=usage, metrics=metrics)
        return envelope, choices

    def _choice(self, request: CompletionRequest, prompt: Prompt, ro: RequestOutput,
                out: CompletionOutput, index: int, prompt_field: Callable[[], Any],
                ) -> CompletionResponseChoice:
        logprobs = prompt_lp = None
        prefix = ""
        if request.echo:
            prefix = self._prompt_text(prompt)
            if request.logprobs is not None:
                prompt_lp = self._logprobs(ro.prompt_token_ids, ro.prompt_logprobs,
                                           request.logprobs, 0,
                                           as_ids=self.tokens_as_ids(request))
        if request.logprobs is not None:
            logprobs = self._logprobs(out.token_ids, out.logprobs, request.logprobs,
                                      len(prefix), prompt_lp,
                                      as_ids=self.tokens_as_ids(request))
        ids = ({"prompt_token_ids": ro.prompt_token_ids, "token_ids": list(out.token_ids)}
               if request.return_token_ids else {})
        return CompletionResponseChoice(
            index=index, text=prefix + out.text, logprobs=logprobs,
            finish_reason=out.finish_reason, stop_reason=out.stop_reason,
            prompt_logprobs=prompt_field(), **ids)

    def _prompt_text(self, prompt: Prompt) -> str:
        text, ids = prompt
        return text if text is not None else self.tokenizer.decode(ids)

    def _logprobs(self, token_ids: list[int], logprobs: list | None, num_top: int,
                  offset: int, into: CompletionLogprobs | None = None,
                  as_ids: bool = False) -> CompletionLogprobs:
        """OpenAI's completion logprobs of `token_ids`; entries of `logprobs` may be None
        (the first prompt token), and a missing list gives None logprobs. `as_ids`:
        tokens named "token_id:<id>" (return_tokens_as_token_ids)."""
        result = into if into is not None else CompletionLogprobs()
        if result.tokens:
            offset = result.text_offset[-1] + len(result.tokens[-1])
        if logprobs and len(logprobs) < len(token_ids):  # prompt logprobs skip token 0
            logprobs = [None] * (len(token_ids) - len(logprobs)) + list(logprobs)
        for k, token_id in enumerate(token_ids):
            step: dict[int, Logprob] | None = logprobs[k] if logprobs else None
            chosen = step.get(token_id) if step else None
            token = self.token_text(token_id, chosen, as_ids)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if chosen is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(clamp_logprob(chosen.logprob))
            top = {self.token_text(t, lp, as_ids): clamp_logprob(lp.logprob)
                   for t, lp in step.items()
                   if t != token_id and lp.rank is not None and lp.rank <= num_top}
            top[token] = clamp_logprob(chosen.logprob)
            result.top_logprobs.append(top)
        return result

    # ------------------------------------------------------------------ streaming

    async def _stream(self, request: CompletionRequest, request_id: str,
                      prompts: list[Prompt], streams: list) -> AsyncIterator[str]:
        state = _StreamState()
        try:
            async for i, ro in merge_streams(streams):
                state.num_prompt_tokens[i] = ro.num_prompt_tokens
                state.num_cached_tokens[i] = ro.num_cached_tokens
                state.latest[i] = ro
                for out in _visible(request, ro.outputs):
                    chunk = self._chunk(request, request_id, prompts, state, i, ro, out)
                    if chunk is not None:
                        yield sse(chunk.model_dump_json(exclude_none=False))
            if request.include_usage or self.serve_config.enable_force_include_usage:
                num_prompt = sum(state.num_prompt_tokens.values())
                num_completion = sum(c.num_tokens for c in state.choices.values())
                usage = self.usage(num_prompt, num_completion,
                                   sum(state.num_cached_tokens.values()))
                final = CompletionResponse(
                    id=request_id, model=self.response_model(request.model), choices=[],
                    usage=usage, metrics=self.timing(list(state.latest.values()),
                                                     num_completion))
                yield sse(final.model_dump_json())
        except Exception as e:
            yield sse_error(e)
        finally:
            self.abort_all(request_id, len(prompts))
        yield sse("[DONE]")

    def _chunk(self, request: CompletionRequest, request_id: str, prompts: list[Prompt],
               state: _StreamState, i: int, ro: RequestOutput,
               out: CompletionOutput) -> CompletionResponse | None:
        index = i * request.n + out.index
        st = state.choices.get(index)
        prefix, logprobs = "", None
        first = st is None
        if st is None:
            st = state.choices[index] = _ChoiceState()
            if request.echo:
                prefix = self._prompt_text(prompts[i])
                if request.logprobs is not None:
                    logprobs = self._logprobs(ro.prompt_token_ids, ro.prompt_logprobs,
                                              request.logprobs, 0,
                                              as_ids=self.tokens_as_ids(request))
        if st.is_finished:
            return None
        # Cumulative output: send what is new. A shorter text (a stop string cut what
        # was held back) sends nothing more.
        delta_text = out.text[st.num_chars:] if len(out.text) > st.num_chars else ""
        new_ids = out.token_ids[st.num_tokens:]
        if request.logprobs is not None and new_ids:
            new_lps = out.logprobs[st.num_tokens:] if out.logprobs else None
            logprobs = self._logprobs(new_ids, new_lps, request.logprobs,
                                      st.offset + len(prefix), logprobs,
                                      as_ids=self.tokens_as_ids(request))
        st.offset += len(prefix) + len(delta_text)
        st.num_chars = max(st.num_chars, len(out.text))
        st.num_tokens = len(out.token_ids)
        st.is_finished = out.finish_reason is not None
        if not (prefix or delta_text or st.is_finished or logprobs or
                (request.return_token_ids and (new_ids or first))):
            return None
        ids = {}
        if request.return_token_ids:
            ids = {"token_ids": list(new_ids)} | (
                {"prompt_token_ids": ro.prompt_token_ids} if first else {})
        choice = CompletionResponseChoice(index=index, text=prefix + delta_text,
                                          logprobs=logprobs, finish_reason=out.finish_reason,
                                          stop_reason=out.stop_reason, **ids)
        chunk = CompletionResponse(id=request_id, model=self.response_model(request.model),
                                   choices=[choice])
        if request.stream_options and request.stream_options.continuous_usage_stats:
            num_completion = sum(c.num_tokens for c in state.choices.values())
            num_prompt = sum(state.num_prompt_tokens.values())
            chunk.usage = self.usage(num_prompt, num_completion,
                                     sum(state.num_cached_tokens.values()))
        return chunk


def _is_echo_only(request: CompletionRequest) -> bool:
    return request.echo and request.max_tokens == 0


def _visible(request: CompletionRequest,
             outputs: list[CompletionOutput]) -> list[CompletionOutput]:
    """The outputs as the client sees them: with echo and max_tokens 0, the one token the
    engine sampled is dropped (text, ids, logprobs), keeping the finish reason."""
    if not _is_echo_only(request):
        return outputs
    return [dataclasses.replace(o, text="", token_ids=[], logprobs=None,
                                cumulative_logprob=None, finish_reason=o.finish_reason
                                and "length") for o in outputs]

