"""RequestOutputCollector: what one request produced and its reader has not taken yet.

The engine makes an output for a request at every step whether or not the request's
reader keeps up: a streamed HTTP response waits on its socket, and a client that keeps
its connection open and reads nothing stops it. Queued one by one, the outputs of such a
request pile up a step at a time, and a cumulative output carries every token (and
logprob) so far: one n = 64 stream of 3,000 tokens grew the server by ~5 MB/s, faster
with every step. The collector holds one output instead: a newer cumulative or final
output replaces the one waiting (it says everything the older one did), and delta
outputs are kept and merged into one when the reader takes them (each holds only what is
new, so they add up to the request's size, not its square).
"""

from __future__ import annotations

import asyncio

from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """One request's outputs (or the error that ended it) until its reader `get`s them.

    `stream_interval` (SchedulerConfig's): the reader is woken once that many new tokens
    wait, per sample, or when the request ends; its first token goes at once (the time
    to first token is not held back).
    """

    def __init__(self, output_kind: RequestOutputKind, stream_interval: int = 1) -> None:
        self.is_delta = output_kind == RequestOutputKind.DELTA
        # A final-only request (and a pooling one) has a single output to wait for.
        self.stream_interval = (1 if output_kind == RequestOutputKind.FINAL_ONLY
                                else stream_interval)
        self._outputs: list[RequestOutput] = []
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        # Tokens per sample: waiting (delta outputs), and already taken by the reader.
        self._waiting = 0
        self._taken = 0

    def put(self, item: RequestOutput | BaseException) -> None:
        """Add an output; an error ends the request (outputs still waiting are dropped:
        the reader gets the error next)."""
        if isinstance(item, BaseException):
            self._error, self._outputs = item, []
        elif self._error is None:
            if self.is_delta:
                self._outputs.append(item)
            else:
                self._outputs = [item]
            if not (item.finished or self._due(item)):
                return
        self._ready.set()

    def _due(self, item: RequestOutput) -> bool:
        if self.stream_interval == 1:
            return True
        tokens = max((len(c.token_ids) for c in item.outputs), default=0)
        if self.is_delta:
            self._waiting += tokens
            new = self._waiting
        else:
            new = tokens - self._taken
        return new >= self.stream_interval or (self._taken == 0 and new > 0)

    async def get(self) -> RequestOutput:
        """The outputs put since the last call, as one (raises the request's error)."""
        while not self._ready.is_set():
            await self._ready.wait()
        if self._error is not None:
            raise self._error  # again at every call: ready stays set
        self._ready.clear()
        outputs, self._outputs = self._outputs, []
        output = outputs[0] if len(outputs) == 1 else merge_deltas(outputs)
        if self.stream_interval > 1:
            tokens = max((len(c.token_ids) for c in output.outputs), default=0)
            self._taken = self._taken + tokens if self.is_delta else tokens
            self._waiting = 0
        return output


def merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """One delta output saying what `outputs` (consecutive deltas of one request) say."""
    last = outputs[-1]
    by_index: dict[int, list[CompletionOutput]] = {}
    for out in outputs:
        for completion in out.outputs:
            by_index.setdefault(completion.index, []).append(completion)
    merged = []
    for index, parts in by_index.items():
        logprobs = None
        if any(p.logprobs is not None for p in parts):
            logprobs = [entry for p in parts for entry in (p.logprobs or ())]
        final = parts[-1]
        merged.append(CompletionOutput(
            index=index, text="".join(p.text for p in parts),
            token_ids=[t for p in parts for t in p.token_ids],
            cumulative_logprob=final.cumulative_logprob, logprobs=logprobs,
            finish_reason=final.finish_reason, stop_reason=final.stop_reason))
    prompt_logprobs = next((o.prompt_logprobs for o in outputs
                            if o.prompt_logprobs is not None), None)
    return RequestOutput(
        request_id=last.request_id, prompt=last.prompt,
        prompt_token_ids=last.prompt_token_ids, outputs=merged, finished=last.finished,
        prompt_logprobs=prompt_logprobs, num_cached_tokens=last.num_cached_tokens,
        metrics=last.metrics, lora_request=last.lora_request,
        num_prompt_tokens=last.num_prompt_tokens)
