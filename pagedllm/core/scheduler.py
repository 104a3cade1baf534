"""Scheduler: one token budget per step, running requests first, then admission.

Each `schedule()` call decides `num_scheduled_tokens` per request: running requests
continue (a decode asks for 1 token, a prompt being prefilled for a chunk), then waiting
requests are admitted in queue order while blocks, budget and `max_num_seqs` allow.
When a running request cannot get a block, the last running request is preempted
(recompute: its blocks are freed and it re-enters the waiting queue).

Policies (`SchedulerConfig.policy`):
- "fcfs": both queues in arrival order; a preempted request re-enters at the front of
  waiting; `Request.priority` is ignored.
- "priority": waiting and running are sorted by (priority, arrival_time), lower first,
  so "the last running request" is the worst one, and a preempted request re-enters
  by its key (ahead of later arrivals of its priority). Before anything is scheduled,
  a waiting head with a strictly smaller priority value than the worst running request,
  that cannot be admitted (max_num_seqs reached or too few free blocks), preempts
  running requests from the back until it fits; it preempts nobody when even
  preempting every worse request would not make room.

Deadlines: a request with `deadline` (absolute `time.monotonic()` time) still live at
the start of a `schedule()` at or after it is finished as FINISHED_TIMEOUT, waiting or
running; its blocks are freed at once and `pop_timed_out_requests()` hands it over.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.contracts import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                     SchedulerOutput)
from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request_queue import RequestQueue, create_request_queue, priority_key
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
    # A running request could not get its blocks (set by _allocate_or_preempt, not by
    # preemptions that make room for a better waiting request).
    is_short_of_blocks: bool = False

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.num_scheduled_tokens[request.req_id] = num_new_tokens
        self.token_budget -= num_new_tokens


class Scheduler:
    """Continuous-batching scheduler over a `KVCacheManager` (pure Python).

    Request lifecycle: WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED (back in
    waiting, recomputed from scratch on re-admission). Only RUNNING requests hold blocks.
    `request.num_computed_tokens` is advanced inside `schedule()` by the tokens scheduled
    (as in vLLM V1): after `schedule()` it counts tokens whose K/V this step will write.
    `clock` is the time source of deadlines (injectable for tests).
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.policy = scheduler_config.policy
        self.clock = clock
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size,
                                               cache_config.enable_prefix_caching)
        # NOTE: a sequence whose K/V outgrows the whole pool could never be scheduled
        # again, so it ends with "length" once it holds capacity + 1 tokens (the last
        # sampled token needs no slot). Only matters when the pool < max_model_len.
        num_slots = (num_blocks - 1) * self.block_size
        self.max_num_tokens = min(self.max_model_len, num_slots + 1)
        # Live requests by id; waiting (in admission order of the policy) and running
        # (fcfs: admission order; priority: sorted by priority_key).
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): sent to the runner then.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Min-heap of (deadline, req_id) of requests added with a deadline. Entries of
        # requests that finished otherwise are dropped lazily when they reach the top.
        self._deadlines: list[tuple[float, str]] = []
        # Finished by their deadline, until pop_timed_out_requests() hands them over.
        self.timed_out_reqs: list[Request] = []

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
        self.waiting.add(request)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.req_id))

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

    def pop_timed_out_requests(self) -> list[Request]:
        """The requests finished as FINISHED_TIMEOUT since the last call."""
        timed_out, self.timed_out_reqs = self.timed_out_reqs, []
        return timed_out

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work; advances num_computed_tokens of scheduled requests."""
        self._finish_expired_requests()
        step = _StepState(token_budget=self.max_num_batched_tokens)
        if self.policy == "priority":
            # Before _schedule_running, so no scheduled request has to be undone.
            self._preempt_for_waiting_head(step)
        self._schedule_running(step)
        # A step whose running requests had to preempt is short of blocks: admitting
        # would only thrash.
        if not step.is_short_of_blocks:
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
            step.is_short_of_blocks = True
            victim = self.running.pop()
            self._preempt(victim, step)
            if victim is request:
                return None

    def _preempt(self, request: Request, step: _StepState) -> None:
        """Recompute-mode preemption: free the blocks, reset, requeue (fcfs: at the front;
        priority: by its key)."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        step.preempted_req_ids.add(request.req_id)

    def _schedule_waiting(self, step: _StepState) -> None:
        """Admit waiting requests in queue order; stop at the first that does not fit (no
        skipping)."""
        kv = self.kv_cache_manager
        while self.waiting and len(self.running) < self.max_num_seqs and step.token_budget > 0:
            request = self.waiting.peek()
            computed_blocks, num_computed_tokens = self._get_computed_blocks(request)
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
            self.waiting.pop()
            if self.policy == "priority":
                # Nothing is preempted after admission, so inserting mid-list is safe.
                bisect.insort_right(self.running, request, key=priority_key)
            else:
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

    def _get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Prefix-cache hits of a waiting request (none when it wants prompt logprobs)."""
        if request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position: no cache hits.
            return [], 0
        return self.kv_cache_manager.get_computed_blocks(request)

    # ---------------------------------------------------------------- priority, deadlines

    def _preempt_for_waiting_head(self, step: _StepState) -> None:
        """Priority policy: preempt worse running requests so the waiting head can start.

        Only while the head has a strictly smaller priority value than the worst running
        request (running[-1]) and cannot be admitted as things stand, and only if
        preempting every worse running request would give it its blocks: otherwise
        preemption could not help and nobody is preempted. Ends: each round preempts one.
        """
        while self.waiting and self.running:
            head = self.waiting.peek()
            if self.running[-1].priority <= head.priority:
                return
            if (len(self.running) < self.max_num_seqs
                    and self._fits_after_preempting(head, ())):
                return  # admissible as is
            # running is sorted by priority_key: the worse requests are a suffix.
            worse = [r for r in self.running if r.priority > head.priority]
            if not self._fits_after_preempting(head, worse):
                return
            self._preempt(self.running.pop(), step)

    def _fits_after_preempting(self, request: Request, victims: Sequence[Request]) -> bool:
        """Whether the pool could hold the uncached part of waiting `request` once every
        request in `victims` were preempted (mirrors allocate_slots' check)."""
        kv = self.kv_cache_manager
        blocks = kv.block_pool.blocks
        computed_blocks, _ = self._get_computed_blocks(request)
        # A block returns to the free queue once all its holders are preempted.
        num_held = Counter(b.block_id for r in victims
                           for b in kv.req_to_blocks.get(r.req_id, ()))
        num_freed = sum(1 for block_id, n in num_held.items()
                        if blocks[block_id].ref_cnt == n)
        # Hits left without a holder sit in the free queue; touching them takes them out
        # of the supply for the new blocks.
        num_evictable_hits = sum(1 for b in computed_blocks
                                 if b.ref_cnt == num_held.get(b.block_id, 0))
        num_new_blocks = kv.num_blocks_needed(request.num_tokens) - len(computed_blocks)
        num_supply = kv.get_num_free_blocks() + num_freed - num_evictable_hits
        return num_new_blocks <= num_supply

    def _finish_expired_requests(self) -> None:
        """Finish every live request whose deadline is <= now as FINISHED_TIMEOUT."""
        heap = self._deadlines
        if not heap:
            return  # no request has a deadline: not even a clock read
        now = self.clock()
        expired: list[str] = []
        while heap and heap[0][0] <= now:
            deadline, req_id = heapq.heappop(heap)
            request = self.requests.get(req_id)
            # Lazy deletion: the request may have finished already (or its id been
            # reused by a later request, whose own entry is elsewhere in the heap).
            if request is not None and request.deadline == deadline:
                expired.append(req_id)
        if expired:
            self.timed_out_reqs += self.finish_requests(expired,
                                                        RequestStatus.FINISHED_TIMEOUT)
        # Entries of requests that finished early linger until their deadline: rebuild
        # when they dominate, so the heap stays O(live requests) (amortized O(1)).
        if len(heap) > 2 * len(self.requests) + 64:
            self._deadlines = [(r.deadline, r.req_id) for r in self.requests.values()
                               if r.deadline is not None]
            heapq.heapify(self._deadlines)

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
