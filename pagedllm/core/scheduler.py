"""Scheduler: one token budget per step, running requests first, then FCFS admission.

Each `schedule()` call decides `num_scheduled_tokens` per request: running requests
continue (a decode asks for 1 token, a prompt being prefilled for a chunk), then waiting
requests are admitted in arrival order while blocks, budget and `max_num_seqs` allow.
When a running request cannot get a block, the last running request is preempted
(recompute: its blocks are freed and it re-enters the front of the waiting queue).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.contracts import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                     SchedulerOutput)
from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.errors import InvalidRequestError
from pagedllm.request import Request, RequestStatus


@dataclass
class _StepState:
    """What one `schedule()` call has decided so far."""

    # Tokens left in this step's budget.
    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.num_scheduled_tokens[request.req_id] = num_new_tokens
        self.token_budget -= num_new_tokens


class Scheduler:
    """Continuous-batching scheduler over a `KVCacheManager` (pure Python).

    Request lifecycle: WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED (back in
    waiting, recomputed from scratch on re-admission). Only RUNNING requests hold blocks.
    `request.num_computed_tokens` is advanced inside `schedule()` by the tokens scheduled
    (as in vLLM V1): after `schedule()` it counts tokens whose K/V this step will write.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size,
                                               cache_config.enable_prefix_caching)
        # NOTE: a sequence whose K/V outgrows the whole pool could never be scheduled
        # again, so it ends with "length" once it holds capacity + 1 tokens (the last
        # sampled token needs no slot). Only matters when the pool < max_model_len.
        num_slots = (num_blocks - 1) * self.block_size
        self.max_num_tokens = min(self.max_model_len, num_slots + 1)
        # Live requests by id; waiting (FCFS, preempted ones in front) and running.
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): sent to the runner then.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0

    # ---------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a request; InvalidRequestError if its prompt can never fit the cache."""
        if request.req_id in self.requests:
            raise InvalidRequestError(f"request id {request.req_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt must contain at least one token")
        num_needed = self.kv_cache_manager.num_blocks_needed(request.num_prompt_tokens)
        num_usable = self.num_blocks - 1  # block 0 is the null block
        if num_needed > num_usable:
            raise InvalidRequestError(
                f"prompt of {request.num_prompt_tokens} tokens needs {num_needed} KV blocks "
                f"but the cache holds only {num_usable} (block_size {self.block_size})")
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """True while finished ids wait to be sent to the runner by the next schedule()."""
        return bool(self.finished_req_ids)

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work; advances num_computed_tokens of scheduled requests."""
        step = _StepState(token_budget=self.max_num_batched_tokens)
        self._schedule_running(step)
        # A step that had to preempt is short of blocks: admitting would only thrash.
        if not step.preempted_req_ids:
            self._schedule_waiting(step)
        output = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(step.num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=step.preempted_req_ids,
        )
        self.finished_req_ids = set()
        # The runner reads num_computed_tokens from the output (values before this step);
        # from here on they include the tokens this step computes.
        for req_id, num_tokens in step.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        return output

    def _schedule_running(self, step: _StepState) -> None:
        """Continue running requests in order; preempt from the back when blocks run out."""
        req_index = 0
        while req_index < len(self.running) and step.token_budget > 0:
            request = self.running[req_index]
            # Chunked prefill: take what is left of the prompt (or 1 token when
            # decoding), capped by the remaining budget.
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens,
                                 step.token_budget)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            new_blocks = self._allocate_or_preempt(request, num_new_tokens, step)
            if new_blocks is None:
                break  # the request preempted itself: nothing after it is left
            step.cached_reqs.append(CachedRequestData(
                req_id=request.req_id,
                new_block_ids=[b.block_id for b in new_blocks],
                num_computed_tokens=request.num_computed_tokens))
            step.add(request, num_new_tokens)
            req_index += 1

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int,
                             step: _StepState) -> list[KVCacheBlock] | None:
        """Allocate for a running request, preempting the last running one until it fits.

        The requests before `request` in `running` are already scheduled this step and
        the victims come from the back, so a scheduled request is never preempted.
        Returns None when `request` itself had to be preempted.
        """
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim, step)
            if victim is request:
                return None

    def _preempt(self, request: Request, step: _StepState) -> None:
        """Recompute-mode preemption: free the blocks, reset, requeue at the front."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        step.preempted_req_ids.add(request.req_id)

    def _schedule_waiting(self, step: _StepState) -> None:
        """Admit waiting requests FCFS; stop at the first that does not fit (no skipping)."""
        kv = self.kv_cache_manager
        while self.waiting and len(self.running) < self.max_num_seqs and step.token_budget > 0:
            request = self.waiting[0]
            computed_blocks, num_computed_tokens = kv.get_computed_blocks(request)
            if request.sampling_params.prompt_logprobs is not None:
                # Prompt logprobs need the logits of every prompt position: no cache hits.
                computed_blocks, num_computed_tokens = [], 0
            # >= 1: the last token is never a prefix hit.
            num_new_tokens = request.num_tokens - num_computed_tokens
            if num_new_tokens > step.token_budget:
                if not self.enable_chunked_prefill:
                    break  # the whole prompt must fit one step
                num_new_tokens = step.token_budget
            new_blocks = kv.allocate_slots(request, num_new_tokens, computed_blocks,
                                           num_computed_tokens)
            if new_blocks is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            request.num_cached_tokens = num_computed_tokens
            step.new_reqs.append(NewRequestData(
                req_id=request.req_id,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=kv.get_block_ids(request.req_id),
                num_computed_tokens=num_computed_tokens,
                eos_token_id=request.eos_token_id))
            step.add(request, num_new_tokens)

    # ---------------------------------------------------------------- update

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        Returns the requests that got new tokens or finished in this step, in the
        runner's order. Requests finished or aborted meanwhile are skipped.
        """
        del scheduler_output  # everything needed is on the requests already
        updated: list[Request] = []
        finished: set[str] = set()
        self._record_prompt_logprobs(model_runner_output)
        all_logprobs = model_runner_output.logprobs
        for i, (req_id, token_ids) in enumerate(zip(model_runner_output.req_ids,
                                                    model_runner_output.sampled_token_ids)):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING or not token_ids:
                continue  # unknown/aborted, or a partial prefill that sampled nothing
            logprobs = all_logprobs[i] if all_logprobs is not None else None
            for j, token_id in enumerate(token_ids):
                request.append_output_token_ids([token_id])
                if logprobs:
                    request.output_logprobs.append(logprobs[j])
                if self._check_stop(request, token_id):
                    break  # tokens after the stop point are dropped
            updated.append(request)
            if request.is_finished:
                finished.add(req_id)
                self._free_request(request)
        if finished:
            self.running = [r for r in self.running if r.req_id not in finished]
        return updated

    def _record_prompt_logprobs(self, model_runner_output: ModelRunnerOutput) -> None:
        for req_id, chunk in (model_runner_output.prompt_logprobs or {}).items():
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.add_prompt_logprobs(chunk)

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Set a FINISHED_* status if `token_id` (just appended) ends the request."""
        params = request.sampling_params
        # EOS and stop ids count only once min_tokens outputs exist (this one included).
        if request.num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = None
                return True
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        max_tokens = request.max_tokens
        if ((max_tokens is not None and request.num_output_tokens >= max_tokens)
                or request.num_tokens >= self.max_num_tokens):
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def finish_requests(self, req_ids: Iterable[str] | str,
                        status: RequestStatus) -> list[Request]:
        """Finish live requests now (abort, or a stop string found downstream).

        Frees their blocks immediately; unknown or already finished ids are ignored.
        Returns the requests finished by this call.
        """
        assert status.is_finished, status
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        finished: list[Request] = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def _free_request(self, request: Request) -> None:
        """Release a finished request's blocks and forget it (status already set)."""
        self.kv_cache_manager.free(request)
        del self.requests[request.req_id]
        self.finished_req_ids.add(request.req_id)
