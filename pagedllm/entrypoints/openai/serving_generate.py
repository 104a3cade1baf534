"""POST /inference/v1/generate: token ids in, token ids out (vLLM's Tokens In<>Out API).

The prompt is taken as the ids it is, with no template or special tokens added; the
response gives each choice's token ids, finish and stop reasons, and logprobs keyed by
token id. With `output_mode` "text" (a server that has a tokenizer) each choice carries
its text as well, and chat-shaped logprobs. A server without a tokenizer
(--tokens-only, --skip-tokenizer-init) detokenizes nothing: stop strings, bad words and
structured outputs are refused there, as each needs the tokenizer.
"""

from __future__ import annotations

import time
import types
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.entrypoints.openai.generate_protocol import (GenerateChoice, GenerateLogProb,
                                                           GenerateLogProbs,
                                                           GenerateLogProbsContent,
                                                           GenerateRequest,
                                                           GenerateResponse,
                                                           GenerateTextChoice)
from pagedllm.entrypoints.openai.protocol import prompt_logprobs_field
from pagedllm.entrypoints.openai.serving_common import (OpenAIServing, SSEResponse,
                                                        clamp_logprob, logprobs_bytes,
                                                        merge_streams,
                                                        prompt_logprobs_bytes, sse,
                                                        sse_error)
from pagedllm.errors import InvalidRequestError
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput

GENERATE_ID_PREFIX = "generate-tokens-"


class OpenAIServingGenerate(OpenAIServing):

    async def generate(self, request: GenerateRequest, request_id: str,
                       ) -> GenerateResponse | SSEResponse | Any:
        """`request_id`: the response's (GENERATE_ID_PREFIX and the caller's id)."""
        self.check_model(request.model)
        self.check_generation()
        spec = request.sampling_params
        text_mode = request.output_mode == "text"
        if self.tokenizer is None:
            if text_mode:
                raise InvalidRequestError(
                    "output_mode \"text\" needs a tokenizer, and this server loads none "
                    "(--tokens-only or --skip-tokenizer-init): ask for output_mode "
                    "\"tokens\"")
            for name in ("stop", "bad_words", "structured_outputs"):
                if getattr(spec, name):
                    raise InvalidRequestError(
                        f"sampling_params.{name} needs a tokenizer, and this server "
                        f"loads none (--tokens-only or --skip-tokenizer-init)"
                        + (": use stop_token_ids" if name == "stop" else ""))
        if text_mode and not spec.detokenize:
            raise InvalidRequestError("output_mode \"text\" requires "
                                      "sampling_params.detokenize to be true")
        if spec.logprobs is not None and spec.logprobs < 0:
            raise InvalidRequestError(f"sampling_params.logprobs must be non-negative, "
                                      f"got {spec.logprobs}")
        # The limits every generation request has (--max-n, --max-stop, logprobs).
        self.check_limits(types.SimpleNamespace(
            n=spec.n, best_of=spec.best_of, prompt_logprobs=spec.prompt_logprobs,
            stream=request.stream, stop=spec.stop, stop_token_ids=spec.stop_token_ids,
            bad_words=spec.bad_words), spec.logprobs)
        kwargs = spec.model_dump(exclude={"output_kind"})
        # Text is made only when something reads it.
        kwargs["detokenize"] = spec.detokenize and bool(text_mode or spec.stop)
        await self.read_constraint(kwargs)
        _, ids = self.truncate(None, request.token_ids, spec.truncate_prompt_tokens)
        kwargs["max_tokens"] = self.check_length(len(ids), spec.max_tokens, kind="prompt")
        params = self.sampling_params(kwargs, request.stream,
                                      self.engine.config.model.sampling_defaults)
        await self.check_constraints(params)
        streams = self.add_requests(request_id, [(None, ids)], [params], request)
        if request.stream:
            return SSEResponse(self._stream(request, request_id, streams),
                               self.serve_config.sse_keep_alive_interval)
        final: RequestOutput | None = None
        try:
            async for _, out in merge_streams(streams):
                final = out
        finally:
            self.abort_all(request_id, 1)  # no-op unless cancelled
        assert final is not None, "every stream ends with a finished output"
        num_tokens = sum(len(o.token_ids) for o in final.outputs)
        size = (prompt_logprobs_bytes(spec.prompt_logprobs, 1, len(ids))
                + logprobs_bytes(spec.logprobs, num_tokens))

        def build() -> GenerateResponse:
            choices = [self._choice(request, out, out.token_ids, out.text, out.logprobs)
                       for out in sorted(final.outputs, key=lambda o: o.index)]
            return GenerateResponse(
                request_id=request_id, output_mode=request.output_mode,
                model=self.response_model(request.model), created=int(time.time()),
                choices=choices,
                usage=self.usage(final.num_prompt_tokens, num_tokens,
                                 final.num_cached_tokens),
                prompt_token_ids=final.prompt_token_ids if request.return_token_ids else None,
                prompt_logprobs=prompt_logprobs_field(final.prompt_logprobs),
                metrics=self.timing([final], num_tokens))
        return await self.json_response(build, size)

    def _choice(self, request: GenerateRequest, out: CompletionOutput, token_ids: list[int],
                text: str | None, logprobs: list | None) -> GenerateChoice:
        """One choice (of a response, or a stream chunk's new part: `token_ids`, `text`
        and `logprobs` are then that part's)."""
        sp = request.sampling_params
        num_top: int | list[int] | None = sp.logprob_token_ids or sp.logprobs
        lps: Any = None
        if num_top is not None:
            lps = (self.chat_logprobs(token_ids, logprobs, num_top,
                                      as_ids=self.tokens_as_ids(request))
                   if request.output_mode == "text"
                   else token_logprobs(token_ids, logprobs, num_top))
        fields = dict(index=out.index, finish_reason=out.finish_reason,
                      stop_reason=out.stop_reason, token_ids=list(token_ids), logprobs=lps)
        if request.output_mode == "text":
            return GenerateTextChoice(text=text or "", **fields)
        return GenerateChoice(**fields)

    async def _stream(self, request: GenerateRequest, request_id: str,
                      streams: list) -> AsyncIterator[str]:
        # Per choice: tokens and characters sent, and whether its finish was.
        sent: dict[int, list[int]] = {}
        finished: set[int] = set()
        prompt_ids = None  # sent on the first chunk only
        latest: RequestOutput | None = None
        include_usage = (bool(request.stream_options and request.stream_options.include_usage)
                         or self.serve_config.enable_force_include_usage)
        continuous = bool(request.stream_options
                          and request.stream_options.continuous_usage_stats)
        exclude = {"model", "created", "prompt_logprobs", "metrics"}
        try:
            async for _, ro in merge_streams(streams):
                if latest is None and request.return_token_ids:
                    prompt_ids = ro.prompt_token_ids
                latest = ro
                for out in ro.outputs:
                    if out.index in finished:
                        continue
                    num_tokens, num_chars = sent.setdefault(out.index, [0, 0])
                    new_ids = out.token_ids[num_tokens:]
                    new_text = out.text[num_chars:] if len(out.text) > num_chars else ""
                    if out.finish_reason is not None:
                        finished.add(out.index)
                    elif not new_ids and not new_text:
                        continue
                    new_lps = out.logprobs[num_tokens:] if out.logprobs else None
                    sent[out.index] = [len(out.token_ids), max(num_chars, len(out.text))]
                    chunk = GenerateResponse(
                        request_id=request_id, output_mode=request.output_mode,
                        choices=[self._choice(request, out, new_ids, new_text, new_lps)])
                    if prompt_ids is not None:
                        chunk.prompt_token_ids, prompt_ids = prompt_ids, None
                    if continuous:
                        chunk.usage = self.usage(ro.num_prompt_tokens,
                                                 sum(n for n, _ in sent.values()),
                                                 ro.num_cached_tokens)
                    yield sse(chunk.model_dump_json(exclude=exclude | _nones(chunk)))
            if include_usage and latest is not None:
                num_tokens = sum(n for n, _ in sent.values())
                final = GenerateResponse(
                    request_id=request_id, output_mode=request.output_mode, choices=[],
                    usage=self.usage(latest.num_prompt_tokens, num_tokens,
                                     latest.num_cached_tokens),
                    metrics=self.timing([latest], num_tokens))
                yield sse(final.model_dump_json(exclude_none=True))
        except Exception as e:
            yield sse_error(e)
        finally:
            self.abort_all(request_id, 1)
        yield sse("[DONE]")


def _nones(chunk: GenerateResponse) -> set[str]:
    """A chunk's optional fields that are unset (left out, as vLLM's chunks do)."""
    return {name for name in ("usage", "prompt_token_ids") if getattr(chunk, name) is None}


def token_logprobs(token_ids: list[int], logprobs: list | None,
                   num_top: int | list[int]) -> GenerateLogProbs:
    """Logprobs keyed by token id: per token its own and max(`num_top`, 1) entries,
    the sampled token's first and then the most likely others by rank (vLLM's list);
    or, `num_top` a list (logprob_token_ids), the sampled token's then the list's."""
    content = []
    for k, token_id in enumerate(token_ids):
        step: dict[int, Logprob] | None = logprobs[k] if logprobs and k < len(
            logprobs) else None
        chosen = step.get(token_id) if step else None
        if chosen is None:
            content.append(GenerateLogProbsContent(token_id=token_id, logprob=-9999.0))
            continue
        top = [GenerateLogProb(token_id=token_id, logprob=clamp_logprob(chosen.logprob),
                               rank=chosen.rank)]
        if isinstance(num_top, list):
            top += [GenerateLogProb(token_id=t, logprob=clamp_logprob(step[t].logprob),
                                    rank=step[t].rank) for t in num_top if t in step]
        else:
            ranked = sorted((lp.rank, t, lp) for t, lp in step.items()
                            if t != token_id and lp.rank is not None and lp.rank <= num_top)
            top += [GenerateLogProb(token_id=t, logprob=clamp_logprob(lp.logprob), rank=rank)
                    for rank, t, lp in ranked[:max(num_top, 1) - 1]]
        content.append(GenerateLogProbsContent(token_id=token_id,
                                               logprob=clamp_logprob(chosen.logprob),
                                               rank=chosen.rank, top_logprobs=top))
    return GenerateLogProbs(content=content)
