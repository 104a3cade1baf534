"""OutputProcessor: Requests updated by a step -> RequestOutputs with text.

Keeps per-request text state (incremental detokenizer) between steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.request import Request


@dataclass
class RequestState:
    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer | None
    arrival_time: float
    num_processed: int = 0
    first_token_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request: Request, prompt: str | None) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        self.states[request.req_id] = RequestState(
            request.req_id, prompt, request.prompt_token_ids, detok, request.arrival_time)

    def has_request(self, req_id: str) -> bool:
        return req_id in self.states

    def process(self, requests: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per updated request; finished ones are forgotten."""
        now = time.monotonic()
        outputs = []
        for req in requests:
            state = self.states.get(req.req_id)
            if state is None:
                continue
            new_ids = req.output_token_ids[state.num_processed:]
            state.num_processed = req.num_output_tokens
            if new_ids and state.first_token_time is None:
                state.first_token_time = now
            if state.detokenizer is not None and new_ids:
                state.detokenizer.add_tokens(new_ids)
            outputs.append(self._make_output(req, state, now))
            if req.is_finished:
                del self.states[req.req_id]
        return outputs

    def _make_output(self, req: Request, state: RequestState, now: float) -> RequestOutput:
        text = state.detokenizer.text if state.detokenizer is not None else ""
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(req.output_token_ids),
            finish_reason=req.status.finish_reason, stop_reason=req.stop_reason)
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        if req.is_finished:
            metrics["finished_time"] = now
        return RequestOutput(request_id=req.req_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=[completion],
                             finished=req.is_finished, num_cached_tokens=req.num_cached_tokens,
                             metrics=metrics)
