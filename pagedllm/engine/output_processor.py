"""OutputProcessor: Requests updated by a step -> RequestOutputs with text and logprobs.

Keeps per-request text state between steps. A user request ("parent") owns one engine
request per sample ("child": the request itself when n == 1, else ids "{id}_{i}");
children are aggregated into one RequestOutput with one CompletionOutput each.

Per child and step: new tokens are detokenized incrementally, stop strings searched in
the new text (a match ends the child: text cut, finish_reason "stop", stop_reason the
string, and the child id is queued in `reqs_to_stop` for the engine to finish it in the
scheduler), and logprobs stored (`FlatLogprobs`). While streaming, the last
len(longest stop) - 1 characters are held back so a stop string is never half-sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.contracts import TokenLogprobs
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
                              FlatLogprobs, Logprob, RequestOutput)
from pagedllm.request import Request
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def find_stop_string(text: str, num_new_chars: int, stops: list[str],
                     ) -> tuple[str, int] | None:
    """Earliest stop string that ends in the last `num_new_chars` characters of `text`
    (the match may straddle old and new text: split across tokens). Returns (stop,
    index).

    Each stop is compared where it would end, at each new character (`startswith`
    checks its first and last characters before the rest): a search (`str.find` over
    the stop's length of tail) prepares the whole stop string every time, and 64 stop
    strings of ~32,000 characters (2 MB) over a text as long cost 2.3 ms a token of
    each sequence, on the event loop (0.1 ms this way).
    """
    best: tuple[str, int] | None = None
    first_end = len(text) - num_new_chars + 1
    for stop in stops:
        for end in range(max(first_end, len(stop)), len(text) + 1):
            if text.startswith(stop, end - len(stop), end):
                if best is None or end - len(stop) < best[1]:
                    best = (stop, end - len(stop))
                break
    return best


@dataclass
class ChildState:
    """Text and logprob state of one engine request."""

    req_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # Every position's so far; a DELTA request's only since its last output (a stream's
    # reader has taken the rest: kept, they grew with the whole output).
    logprobs: FlatLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # What the previous DELTA output already carried.
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    # Whether something changed since the last output (DELTA skips unchanged children).
    is_updated: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible_text(self) -> str:
        """The text that may be sent now: all of it once finished, else minus holdback."""
        hold = 0 if self.finished else self.params.output_text_buffer_length
        return self.text[:len(self.text) - hold] if hold else self.text


@dataclass
class ParentRequest:
    """One user request: its prompt, options and children."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    children: list[ChildState]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # prompt_logprobs as they are built, chunk by chunk while the prompt is prefilled
    # (one 8,000-token prompt at k = 20 is ~0.6 s of Python: the server's event loop
    # gets it in steps); published as prompt_logprobs once whole.
    prompt_logprobs_so_far: list[dict[int, Logprob] | None] = field(
        default_factory=lambda: [None])
    first_token_time: float | None = None
    # When a child was first scheduled (the earliest), and when a token last came.
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    sent_prompt_logprobs: bool = False
    # An embedding request (one child, never samples) and its pooled vector once back.
    is_pooling: bool = False
    # Its prompt came as embeddings: prompt_token_ids are placeholders, never shown.
    prompt_is_embeds: bool = False
    embedding: list[float] | None = None
    lora_request: LoRARequest | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, tuple[ParentRequest, ChildState]] = {}
        # Children ended by a stop string this step: the engine must finish them in the
        # scheduler (EngineCore.stop_requests). Drained by `take_reqs_to_stop`.
        self.reqs_to_stop: list[str] = []
        self._token_text: dict[int, str] = {}

    def add_request(self, request: Request | list[Request], prompt: str | None,
                    params: SamplingParams | None = None,
                    request_id: str | None = None) -> None:
        """Track a user request whose engine requests are `request` (one per sample).

        `params` and `request_id` are the user's (default: the single request's own).
        """
        requests = request if isinstance(request, list) else [request]
        first = requests[0]
        params = params or first.sampling_params
        children = [ChildState(r.req_id, i, r.sampling_params, self._detokenizer(r))
                    for i, r in enumerate(requests)]
        parent = ParentRequest(request_id or first.req_id, prompt, first.prompt_token_ids,
                               params, first.arrival_time, children,
                               is_pooling=first.is_pooling, lora_request=first.lora_request,
                               prompt_is_embeds=first.has_prompt_embeds)
        self.parents[parent.request_id] = parent
        for child in children:
            self.children[child.req_id] = (parent, child)

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer | None:
        sp = request.sampling_params
        if self.tokenizer is None or not sp.detokenize or request.is_pooling:
            return None
        # No prompt text to continue from when the prompt was embeddings.
        context = [] if request.has_prompt_embeds else request.prompt_token_ids
        return IncrementalDetokenizer(self.tokenizer, context,
                                      sp.skip_special_tokens,
                                      sp.spaces_between_special_tokens)

    def has_request(self, req_id: str) -> bool:
        return req_id in self.parents or req_id in self.children

    def child_req_ids(self, request_id: str) -> list[str]:
        """Engine request ids of a user request ([] if unknown)."""
        parent = self.parents.get(request_id)
        return [c.req_id for c in parent.children] if parent is not None else []

    def parent_id(self, req_id: str) -> str:
        """The user request an engine request belongs to (itself if unknown)."""
        entry = self.children.get(req_id)
        return entry[0].request_id if entry is not None else req_id

    def take_reqs_to_stop(self) -> list[str]:
        ids, self.reqs_to_stop = self.reqs_to_stop, []
        return ids

    def process(self, requests: list[Request],
                ) -> list[RequestOutput | EmbeddingRequestOutput]:
        """RequestOutputs of the user requests touched by `requests` (an
        EmbeddingRequestOutput for a finished embedding request); finished ones are
        forgotten. Call `take_reqs_to_stop` afterwards and stop those in the engine."""
        now = time.monotonic()
        touched: dict[str, ParentRequest] = {}
        for req in requests:
            entry = self.children.get(req.req_id)
            if entry is None or entry[1].finished:
                continue
            parent, child = entry
            if req.is_pooling and req.pooler_output:
                parent.embedding = req.pooler_output
            if self._update_child(parent, child, req, now):
                touched[parent.request_id] = parent
        outputs = []
        for parent in touched.values():
            out = self._make_output(parent, now)
            if out is not None:
                outputs.append(out)
            if parent.finished:
                del self.parents[parent.request_id]
                for child in parent.children:
                    self.children.pop(child.req_id, None)
        return outputs

    # ------------------------------------------------------------------ per child

    def _update_child(self, parent: ParentRequest, child: ChildState, req: Request,
                      now: float) -> bool:
        """Apply what `req` gained; False when that was only a part of its prompt
        logprobs (nothing to show the user yet)."""
        new_ids = req.output_token_ids[len(child.token_ids):]
        if parent.prompt_logprobs is None and req.sampling_params.prompt_logprobs is not None:
            self._add_prompt_logprobs(parent, req)
            if parent.prompt_logprobs is None and not new_ids and not req.is_finished:
                return False
        child.is_updated = True
        child.num_cached_tokens = req.num_cached_tokens
        if new_ids and parent.first_token_time is None:
            parent.first_token_time = now
        if new_ids:
            parent.last_token_time = now
        if req.first_scheduled_time is not None and (
                parent.first_scheduled_time is None
                or req.first_scheduled_time < parent.first_scheduled_time):
            parent.first_scheduled_time = req.first_scheduled_time
        if child.params.logprobs is not None:
            self._add_logprobs(child, req.take_output_logprobs())
        child.token_ids.extend(new_ids)
        if child.detokenizer is not None and new_ids:
            delta = child.detokenizer.add_tokens(new_ids)
            child.text = child.detokenizer.text
            if self._check_stop_strings(child, len(delta)):
                self.reqs_to_stop.append(child.req_id)
                return True
        if req.is_finished:
            child.finish_reason = req.status.finish_reason
            child.stop_reason = req.stop_reason
        return True

    def _check_stop_strings(self, child: ChildState, num_new_chars: int) -> bool:
        sp = child.params
        if not sp.stop or not num_new_chars or len(child.token_ids) < sp.min_tokens:
            return False
        found = find_stop_string(child.text, num_new_chars, sp.stop)
        if found is None:
            return False
        stop, idx = found
        end = idx + len(stop) if sp.include_stop_str_in_output else idx
        child.text = child.text[:end]
        child.finish_reason, child.stop_reason = "stop", stop
        return True

    def _add_logprobs(self, child: ChildState, entries: list[TokenLogprobs]) -> None:
        if child.logprobs is None:
            child.logprobs, child.cumulative_logprob = FlatLogprobs(), 0.0
        decode = child.detokenizer is not None
        for entry in entries:
            texts = [self._decode_token(t) for t in entry.token_ids] if decode else None
            child.logprobs.append(entry.token_ids, entry.logprobs, entry.ranks, texts)
            child.cumulative_logprob += entry.logprobs[0]

    def _logprob_dict(self, entry: TokenLogprobs, decode: bool) -> dict[int, Logprob]:
        """Chosen token first, then the top-k, each with its rank in the whole vocabulary."""
        out: dict[int, Logprob] = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token_id not in out:  # the chosen token may also be one of the top-k
                out[token_id] = Logprob(logprob, rank,
                                        self._decode_token(token_id) if decode else None)
        return out

    def _decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def _add_prompt_logprobs(self, parent: ParentRequest, req: Request) -> None:
        """Convert the prompt logprobs scored since the last call; publish them once the
        whole prompt is scored (the first token has no logprob)."""
        so_far = parent.prompt_logprobs_so_far
        decode = self.tokenizer is not None and req.sampling_params.detokenize
        # Entry i of req.prompt_logprobs scores prompt token i + 1 (append-only).
        so_far.extend(self._logprob_dict(e, decode)
                      for e in req.prompt_logprobs[len(so_far) - 1:])
        if len(so_far) >= req.num_prompt_tokens:
            parent.prompt_logprobs, parent.prompt_logprobs_so_far = so_far, []

    # ------------------------------------------------------------------ outputs

    def _make_output(self, parent: ParentRequest, now: float,
                     ) -> RequestOutput | EmbeddingRequestOutput | None:
        if parent.is_pooling:
            return self._embedding_output(parent) if parent.finished else None
        sp = parent.params
        kind = sp.output_kind
        num_samples = len(parent.children)
        if (kind == RequestOutputKind.FINAL_ONLY or num_samples > sp.n) and not parent.finished:
            return None  # best_of needs every sample to rank them
        if kind == RequestOutputKind.DELTA:
            completions = [self._delta_completion(c) for c in parent.children
                           if c.is_updated]
        else:
            completions = [self._completion(c) for c in parent.children]
        if num_samples > sp.n:
            completions = self._best(completions, sp)
        for child in parent.children:
            child.is_updated = False
        prompt_logprobs = parent.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            # Deltas carry the prompt logprobs once, in the first output.
            if parent.sent_prompt_logprobs:
                prompt_logprobs = None
            parent.sent_prompt_logprobs = prompt_logprobs is not None
        metrics = {"arrival_time": parent.arrival_time}
        for name in ("first_scheduled_time", "first_token_time", "last_token_time"):
            if getattr(parent, name) is not None:
                metrics[name] = getattr(parent, name)
        if parent.finished:
            metrics["finished_time"] = now
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=None if parent.prompt_is_embeds else parent.prompt_token_ids,
            outputs=completions, finished=parent.finished, prompt_logprobs=prompt_logprobs,
            num_cached_tokens=max(c.num_cached_tokens for c in parent.children),
            metrics=metrics, lora_request=parent.lora_request,
            num_prompt_tokens=len(parent.prompt_token_ids))

    @staticmethod
    def _embedding_output(parent: ParentRequest) -> EmbeddingRequestOutput:
        child = parent.children[0]
        return EmbeddingRequestOutput(
            request_id=parent.request_id,
            outputs=EmbeddingOutput(embedding=list(parent.embedding or [])),
            prompt_token_ids=parent.prompt_token_ids, finished=True,
            num_cached_tokens=child.num_cached_tokens,
            finish_reason=child.finish_reason or "abort")

    @staticmethod
    def _completion(child: ChildState) -> CompletionOutput:
        return CompletionOutput(
            index=child.index, text=child.visible_text(), token_ids=list(child.token_ids),
            cumulative_logprob=child.cumulative_logprob,
            logprobs=child.logprobs.head() if child.logprobs is not None else None,
            finish_reason=child.finish_reason, stop_reason=child.stop_reason)

    @staticmethod
    def _delta_completion(child: ChildState) -> CompletionOutput:
        text = child.visible_text()
        delta = CompletionOutput(
            index=child.index, text=text[child.num_sent_chars:],
            token_ids=child.token_ids[child.num_sent_tokens:],
            cumulative_logprob=child.cumulative_logprob, logprobs=child.logprobs,
            finish_reason=child.finish_reason, stop_reason=child.stop_reason)
        if child.logprobs is not None:
            child.logprobs = FlatLogprobs()  # the positions after this delta's
        child.num_sent_chars = len(text)
        child.num_sent_tokens = len(child.token_ids)
        return delta

    @staticmethod
    def _best(completions: list[CompletionOutput], sp: SamplingParams,
              ) -> list[CompletionOutput]:
        """best_of: the n completions with the highest cumulative logprob, re-indexed."""
        ranked = sorted(completions, key=lambda c: c.cumulative_logprob
                        if c.cumulative_logprob is not None else float("-inf"), reverse=True)
        best = ranked[:sp.n]
        for i, completion in enumerate(best):
            completion.index = i
            if sp.logprobs is None:
                completion.logprobs = None  # computed only for the ranking
        return best
