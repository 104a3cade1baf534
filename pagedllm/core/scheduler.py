"""Scheduler: one token budget per step, running requests first, then admission.

Each `schedule()` call decides `num_scheduled_tokens` per request: running requests
continue (a decode asks for 1 token, a prompt being prefilled for a chunk), then waiting
requests are admitted in queue order while blocks, budget and `max_num_seqs` allow
(`max_num_active_seqs` running at most, if lower; beside requests the step already runs,
an admission must leave the watermark's blocks free, and with `reserve_full_prompt`
the free blocks must hold its whole prompt besides the rest of the running prompts).
When a running request cannot get a block, the last running request is preempted.

Preemption modes (`SchedulerConfig.preemption_mode`):
- "recompute": its blocks are freed and it re-enters the waiting queue, to be
  recomputed from its tokens.
- "swap": its blocks are copied to host blocks (`SwapSpace`, core/swap.py) and it waits
  in the `swapped` queue keeping num_computed_tokens; it falls back to recompute when the
  host pool cannot take all its blocks. Swapped requests come back before new waiting
  ones (fcfs: swapped first, in swap order; priority: the better of the two queue
  heads first), and a step that had to preempt admits nobody. The step's swap-outs are
  all decided before its first swap-in, so the runner runs them in that order.

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

Steps in flight (pipeline parallelism, `pipeline_depth` > 1): the engine may schedule
the next step before the last one's output is back. A request scheduled in a step whose
output has not come back (`update_from_output`) is in flight: it is neither scheduled
again nor chosen as a preemption victim until then. A step holds at most
ceil(max_num_seqs / pipeline_depth) requests, so the running requests spread over
`pipeline_depth` steps that keep every stage busy (as vLLM V0's virtual engines split
them), and each continuing request carries the token sampled for it since it last ran
(the pipeline's runners do not share their samples).

Cost budget (`SchedulerConfig.attention_pairs_per_token` > 0): a prefill chunk also
costs its attention over the tokens before it, so besides the token budget a step's
chunks may cost only what a fresh prompt of the whole budget costs (StepState
.chunk_cost); deep into a long prompt its chunks shrink, and every step, with the
decodes that share it, stays about as long as the first. A request that wants prompt
logprobs pays for scoring its positions too (`prompt_logprob_cost` a token).

Long prefills (`SchedulerConfig.long_prefill_token_threshold` > 0, vLLM's): while
other requests are live, a prompt chunk takes at most that many tokens a step, so a
long prompt being prefilled leaves the rest of the budget to the requests behind it
(their first tokens do not wait for the whole long prompt); alone it takes what the
budget allows, as without the cap (vLLM caps it always).

KV cache groups (core/kv_groups.py): with sliding-window layers a request holds blocks
per group; block ids, allocation and preemption span the groups, and `CachedRequestData`
carries each group's new blocks.

Speculative decoding: the runner proposes tokens to follow a request
(`ModelRunnerOutput.spec_token_ids`); the next step that continues the request schedules
them after its last token (1 + k tokens, k capped by the budget, max_tokens and the
longest sequence) and lists them in `scheduled_spec_decode_tokens`. The runner emits
the tokens it accepted plus one of its own, and `update_from_output` takes back the
K/V of the rejected ones: num_computed_tokens drops by k + 1 - emitted (their slots stay
allocated and are overwritten next step; blocks are cached only up to num_tokens, so a
draft never enters the prefix cache). With `num_lookahead_tokens` (a draft model writes
its own K/V for the tokens it proposes) a step that samples also reserves that many
slots beyond its tokens.

Async scheduling (`SchedulerConfig.async_scheduling`): the engine schedules step N + 1
while step N runs, with at most one step in flight at a `schedule()`. A request whose
step N samples (its scheduled tokens reach the end of its known sequence) gets a
placeholder (`Request.num_output_placeholders`): it counts as a token for scheduling, so
the request continues in N + 1 with one token, whose id the runner takes from N's
sampled ids on the device. `update_from_output` of N removes it. A request in flight
is scheduled again only when what it has pending cannot finish it by length (max_tokens,
the longest sequence); one finished by N's token (EOS, a stop id) wastes its N + 1 token,
which is dropped with the request. Requests in flight are still never preempted: when
only those could make room (for a running request's blocks, or for a better waiting
request under the priority policy), the step goes without it and `can_overlap()` turns
False, so the engine schedules the next step after N's output, with nothing in flight.
`can_overlap()` is also False while a live request needs its previous token on the host
to be sampled (penalties, bad words, min_tokens, a grammar): the engine then waits for
each step before the next.

KV store (`kv_store`, core/kv_store.py: blocks shared with other engines through a
directory): a waiting request admitted with prefix hits for its first k blocks also takes
the blocks after them that the store holds, as fresh blocks the runner fills from the
files before the step's forward pass (`kv_blocks_to_load`), so it computes only the
rest; each step asks the runner to save the prompt blocks it completes that the store
lacks (`kv_blocks_to_save`). A block whose load fails is dropped from the prefix cache
and every request holding it fails, or (kv_load_failure_policy "recompute") goes back
to the front of the waiting queue as a recompute preemption would, unless a step in
flight still holds it (async scheduling): then it fails. The prefix cache's host tier
(core/kv_offload.py, kv_offloading_size) takes the store's place through the same calls:
its loads are (host slot, block id), its saves every full block a step completes.

Deadlines: a request with `deadline` (absolute `time.monotonic()` time) still live at
the start of a `schedule()` at or after it is finished as FINISHED_TIMEOUT, waiting,
swapped or running; its blocks are freed at once and `pop_timed_out_requests()` hands it over.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.deadlines import DeadlineHeap
from pagedllm.core.kv_cache_manager import GroupBlocks, KVCacheManager
from pagedllm.core.kv_offload import HostKVStore
from pagedllm.core.kv_store import KVStore
from pagedllm.core.output_update import apply_runner_output
from pagedllm.core.request_queue import RequestQueue, create_request_queue, priority_key
from pagedllm.core.step_state import StepState
from pagedllm.core.swap import SwapSpace
from pagedllm.errors import InvalidRequestError
from pagedllm.request import Request, RequestStatus


class Scheduler:
    """Continuous-batching scheduler over a `KVCacheManager` (pure Python).

    Request lifecycle: WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED (back in
    waiting, recomputed from scratch on re-admission); RUNNING -> SWAPPED (in `swapped`,
    holding host blocks only) -> RUNNING. Only RUNNING requests hold device blocks.
    `request.num_computed_tokens` is advanced inside `schedule()` by the tokens scheduled
    (as in vLLM V1): after `schedule()` it counts tokens whose K/V this step will write.
    `num_swap_blocks` sizes the host pool of swap preemption (block 0 included, never
    used; < 2: no pool, every preemption recomputes). `clock` is the time source of
    deadlines (injectable for tests). `hash_prompt_rows`: the model computes prompt
    rows on other kernels than generated ones, so prefix-cache hashes tell them apart
    (core/block_hash.py).
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, num_swap_blocks: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 pipeline_depth: int = 1,
                 group_windows: Sequence[int | None] = (None,),
                 num_lookahead_tokens: int = 0, hash_prompt_rows: bool = False,
                 enable_kv_events: bool = False,
                 kv_store: KVStore | HostKVStore | None = None,
                 kv_load_failure_policy: str = "fail",
                 residency_sample_rate: float = 0.0) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        # Admission's limits: running requests at most, and blocks an admission beside
        # scheduled requests must leave free (the watermark).
        self.max_num_active_seqs = (scheduler_config.max_num_active_seqs
                                    or self.max_num_seqs)
        self.watermark_blocks = int(scheduler_config.watermark * num_blocks)
        self.reserve_full_prompt = scheduler_config.reserve_full_prompt
        # The step's budget (max_num_scheduled_tokens when set, below the runner's size).
        self.max_num_batched_tokens = scheduler_config.step_budget
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.attention_pairs_per_token = scheduler_config.attention_pairs_per_token
        self.prompt_logprob_cost = scheduler_config.prompt_logprob_cost
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.policy = scheduler_config.policy
        self.max_loras = scheduler_config.max_loras
        self.clock = clock
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size,
                                               cache_config.enable_prefix_caching,
                                               group_windows, hash_prompt_rows,
                                               enable_kv_events, residency_sample_rate)
        # NOTE: a sequence whose K/V outgrows the whole pool could never be scheduled
        # again, so it ends with "length" once it holds capacity + 1 tokens (the last
        # sampled token needs no slot). Only matters when the pool < max_model_len.
        capacity = self.kv_cache_manager.max_num_tokens(num_blocks - 1)
        self.max_num_tokens = min(self.max_model_len, capacity + 1)
        # Live requests by id; waiting (in admission order of the policy) and running
        # (fcfs: admission order; priority: sorted by priority_key).
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): sent to the runner then.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Swap preemption: the host pool (None: recompute only) and the swapped requests
        # (fcfs: in swap order; priority: by priority_key).
        self.preemption_mode = scheduler_config.preemption_mode
        self.swap_space: SwapSpace | None = None
        if self.preemption_mode == "swap" and num_swap_blocks >= 2:
            self.swap_space = SwapSpace(num_swap_blocks)
        self.swapped: RequestQueue = create_request_queue(self.policy)
        self.num_swaps_out = 0
        self.num_swaps_in = 0
        # Tokens scheduled since start-up (recomputed ones counted again: benchmarks
        # compare preemption modes by it).
        self.num_scheduled_tokens_total = 0
        # Deadlines of live requests added with one.
        self._deadlines = DeadlineHeap()
        # Finished by their deadline, until pop_timed_out_requests() hands them over.
        self.timed_out_reqs: list[Request] = []
        # Ids of requests in steps whose output is not back yet, with the number of such
        # steps (async scheduling can hold a request in two: one in flight, one being
        # scheduled).
        self.in_flight: Counter[str] = Counter()
        self.async_scheduling = scheduler_config.async_scheduling
        # Live requests that need their previous token on the host, and whether the last
        # schedule() wanted to preempt requests in flight (can_overlap).
        self._num_needing_host_tokens = 0
        self._victims_in_flight = False
        self.send_token_ids = pipeline_depth > 1
        self.max_num_seqs_per_step = -(-self.max_num_seqs // pipeline_depth)
        # Speculative decoding: slots reserved past a sampling step's tokens, and the
        # proposed / accepted token counts since start-up (acceptance rate).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Blocks shared with other engines (None: none), and requests sent back to
        # waiting outside schedule() (a failed load) whose runner state the next step's
        # output drops.
        self.kv_store = kv_store
        self.kv_load_failure_policy = kv_load_failure_policy
        self._preempted_since_step: set[str] = set()
        # Paused admissions (vLLM's pause_generation, modes "abort" and "wait"): the
        # waiting requests that never ran, and those that arrive, wait here, out of the
        # queue, until release_held(); the running ones run on. None: not holding.
        self.held: dict[str, Request] | None = None

    # ---------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a request; InvalidRequestError if its prompt can never fit the cache."""
        self.check_request(request)
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        if self.held is not None:
            self.held[request.req_id] = request
        else:
            self.waiting.add(request)
        self._num_needing_host_tokens += needs_host_tokens(request)
        if request.deadline is not None:
            self._deadlines.push(request)

    def check_request(self, request: Request) -> None:
        """InvalidRequestError if `add_request` would refuse the request (its id is live,
        or its prompt is empty or can never be scheduled)."""
        if request.req_id in self.requests:
            raise InvalidRequestError(f"request id {request.req_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt must contain at least one token")
        num_needed = self.kv_cache_manager.num_blocks_for_prompt(request.num_prompt_tokens)
        num_usable = self.num_blocks - 1  # block 0 is the null block
        if num_needed > num_usable:
            raise InvalidRequestError(
                f"prompt of {request.num_prompt_tokens} tokens needs {num_needed} KV blocks "
                f"but the cache holds only {num_usable} (block_size {self.block_size})")
        if request.is_pooling and request.num_prompt_tokens > self.max_num_batched_tokens:
            # Pooling needs the whole prompt in one step (no chunked prefill).
            raise InvalidRequestError(
                f"the prompt of an embedding request is computed in one step, but it has "
                f"{request.num_prompt_tokens} tokens and a step holds at most "
                f"{self.max_num_batched_tokens} (max_num_batched_tokens, or "
                f"max_num_scheduled_tokens)")

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.held or ())

    def hold_new_requests(self) -> None:
        """Admit no request that has not run yet (they and new arrivals are held)
        until release_held(); preempted and swapped requests are still resumed."""
        if self.held is not None:
            return
        self.held = {}
        for request in list(self.waiting):
            if request.num_preemptions == 0:
                self.waiting.remove(request)
                self.held[request.req_id] = request

    def release_held(self) -> None:
        """Admit again: the held requests go back to the queue, in arrival order."""
        held, self.held = self.held or {}, None
        for request in sorted(held.values(), key=lambda r: r.arrival_time):
            self.waiting.add(request)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_swapped_blocks(self) -> int:
        """Host blocks held by swapped-out requests."""
        return self.swap_space.num_swapped_blocks if self.swap_space is not None else 0

    def get_num_unfinished_requests(self) -> int:
        """Requests the scheduler may run now (held ones are not counted: an engine
        with only those is idle)."""
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the last one's output is back:
        no live request needs its previous token on the host first (a penalty, bad words
        or min_tokens read the token history when sampling, a grammar is advanced by
        each token), and the last schedule() left no request out for want of a victim
        not in flight."""
        return self._num_needing_host_tokens == 0 and not self._victims_in_flight

    def pop_timed_out_requests(self) -> list[Request]:
        """The requests finished as FINISHED_TIMEOUT since the last call."""
        timed_out, self.timed_out_reqs = self.timed_out_reqs, []
        return timed_out

    def expire(self) -> list[Request]:
        """Finish the requests past their deadline now, outside schedule(): what an engine
        that runs no step (its requests held, or itself frozen) still does. Returns
        every request timed out since the last pop_timed_out_requests."""
        self._finish_expired_requests()
        return self.pop_timed_out_requests()

    def next_deadline(self) -> float | None:
        """The clock's time of the earliest deadline of a live request (or earlier)."""
        return self._deadlines.earliest()

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work; advances num_computed_tokens of scheduled requests."""
        self._finish_expired_requests()
        self._victims_in_flight = False
        step = StepState(self.max_num_batched_tokens, self.max_num_tokens,
                         self.enable_chunked_prefill, self.num_lookahead_tokens,
                         attention_pairs_per_token=self.attention_pairs_per_token,
                         prompt_logprob_cost=self.prompt_logprob_cost,
                         # Only while another request could use the budget: alone, a
                         # long prompt gains nothing by smaller steps.
                         long_prefill_token_threshold=(self.long_prefill_token_threshold
                                                       if len(self.requests) > 1 else 0))
        if self.policy == "priority":
            # Before _schedule_running, so no scheduled request has to be undone.
            self._preempt_for_waiting_head(step)
        self._schedule_running(step)
        # A step whose running requests had to preempt is short of blocks: admitting
        # would only thrash.
        if not step.is_short_of_blocks:
            self._schedule_admissions(step)
        if self.kv_store is not None and self.kv_store.save:
            step.kv_saves = self.kv_store.plan_saves(self.requests, step.num_scheduled_tokens,
                                                     self.kv_cache_manager)
        if self._preempted_since_step:  # (a failed KV load's recompute: rare)
            step.preempted_req_ids |= self._preempted_since_step
            self._preempted_since_step = set()
        output = step.to_output(self.finished_req_ids)
        self.finished_req_ids = set()
        # The runner reads num_computed_tokens from the output (values before this step);
        # from here on they include the tokens this step computes.
        for req_id, num_tokens in step.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_tokens
            if (self.async_scheduling and not request.is_pooling
                    and request.num_computed_tokens
                    >= request.num_tokens + request.num_output_placeholders):
                request.num_output_placeholders += 1  # it samples in this step
        self.in_flight.update(step.num_scheduled_tokens.keys())
        self.num_scheduled_tokens_total += output.total_num_scheduled_tokens
        return output

    def _schedule_running(self, step: StepState) -> None:
        """Continue running requests in order; preempt from the back when blocks run out."""
        req_index = 0
        while (req_index < len(self.running) and step.token_budget > 0
               and len(step.num_scheduled_tokens) < self.max_num_seqs_per_step):
            request = self.running[req_index]
            # Chunked prefill: take what is left of the prompt (or 1 token when
            # decoding; a placeholder counts as known), capped by the remaining budget.
            num_new_tokens = step.cap_chunk(request, request.num_computed_tokens, min(
                request.num_tokens + request.num_output_placeholders
                - request.num_computed_tokens, step.token_budget))
            if num_new_tokens <= 0 or (request.req_id in self.in_flight
                                       and not self._may_continue_in_flight(request)):
                req_index += 1
                continue
            spec_token_ids = step.spec_tokens_to_schedule(request)
            num_new_tokens += len(spec_token_ids)
            new_blocks = self._allocate_or_preempt(request, req_index, num_new_tokens, step)
            if new_blocks is None:
                break  # the request preempted itself: nothing after it is left
            if spec_token_ids:
                step.spec_tokens[request.req_id] = spec_token_ids
            new_token_ids = []
            if self.send_token_ids:
                # The runner holds the prompt and every token up to what was computed.
                start = max(request.num_computed_tokens, request.num_prompt_tokens)
                new_token_ids = request.all_token_ids[start:]
            step.add_cached(request, num_new_tokens, new_blocks, new_token_ids)
            req_index += 1

    def _may_continue_in_flight(self, request: Request) -> bool:
        """Async scheduling: a request in flight continues unless the tokens it has
        pending already end it by length."""
        if not self.async_scheduling:
            return False
        num_tokens = request.num_tokens + request.num_output_placeholders
        max_tokens = request.max_tokens
        return not ((max_tokens is not None and num_tokens - request.num_prompt_tokens
                     >= max_tokens) or num_tokens >= self.max_num_tokens)

    def _allocate_or_preempt(self, request: Request, index: int, num_new_tokens: int,
                             step: StepState) -> list[list[KVCacheBlock]] | None:
        """Allocate for running[index], preempting the last running request not in
        flight until it fits.

        The requests before `index` are already scheduled this step and the victims come
        from the back, so a scheduled request is never preempted. Returns None when
        `request` itself had to be preempted, or (async scheduling, where `request` may
        be in flight itself) when every candidate is in flight: then nothing is
        preempted and it waits.
        """
        num_lookahead = step.num_lookahead(request, request.num_computed_tokens,
                                           num_new_tokens)
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=num_lookahead)
            if new_blocks is not None:
                return new_blocks
            step.is_short_of_blocks = True
            victim_index = self._last_preemptible(index)
            if victim_index < 0:  # every candidate is in flight (async scheduling)
                self._victims_in_flight = True
                return None
            victim = self.running.pop(victim_index)
            self._preempt(victim, step)
            if victim is request:
                return None

    def _last_preemptible(self, start: int = 0) -> int:
        """Index of the last request of running[start:] not in flight (-1: none)."""
        for i in range(len(self.running) - 1, start - 1, -1):
            if self.running[i].req_id not in self.in_flight:
                return i
        return -1

    def _preempt(self, request: Request, step: StepState | None) -> None:
        """Preempt a running request (already out of `running`, not scheduled this step).

        Swap mode with room on the host: copy its blocks out, keep num_computed_tokens,
        queue it in `swapped`. Otherwise recompute: free the blocks, reset, requeue in
        waiting (fcfs: at the front; priority: by its key). `step` None: outside
        schedule() (its KV failed to load): recomputed, and the next step's output tells
        the runner.
        """
        kv = self.kv_cache_manager
        if (step is not None and self.swap_space is not None
                and self.swap_space.can_swap_out(kv, request)):
            # Swap-outs precede swap-ins within a step (the runner copies in that order,
            # and a host block freed by a swap-in must not be overwritten first).
            assert not step.blocks_to_swap_in, "swap-out after a swap-in in one step"
            step.blocks_to_swap_out += self.swap_space.swap_out(kv, request)
            request.status = RequestStatus.SWAPPED
            self.swapped.add(request)
            self.num_swaps_out += 1
        else:
            kv.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            self.waiting.prepend(request)
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        preempted = step.preempted_req_ids if step is not None else self._preempted_since_step
        preempted.add(request.req_id)

    def _schedule_admissions(self, step: StepState) -> None:
        """Swap in swapped requests and admit waiting ones, in `_next_queue` order; stop
        at the first that does not fit (no skipping, so neither queue is starved)."""
        while (len(self.running) < self.max_num_active_seqs and step.token_budget > 0
               and len(step.num_scheduled_tokens) < self.max_num_seqs_per_step):
            queue = self._next_queue()
            if queue is None:
                return
            request = queue.peek()
            if not self._lora_fits(request):
                return  # its adapter waits for one of the running ones to finish
            if queue is self.swapped:
                if request.req_id in step.preempted_req_ids:
                    return  # swapped out by this very step: no round trip
                if not self._swap_in(request, step):
                    return
            elif not self._admit(request, step):
                return
            queue.pop()

    def _lora_fits(self, request: Request) -> bool:
        """Whether `request` may start running beside the running requests: its LoRA
        adapter, if any, is one of theirs or a new one within max_loras."""
        lora_id = request.lora_int_id
        if not lora_id or self.max_loras is None:
            return True
        running = {r.lora_int_id for r in self.running} - {0}
        return lora_id in running or len(running) < self.max_loras

    def _next_queue(self) -> RequestQueue | None:
        """The queue whose head goes next: swapped before waiting (fcfs), or the better
        head by priority_key, swapped on a tie (priority); None when both are empty."""
        if not self.swapped:
            return self.waiting if self.waiting else None
        if (self.waiting and self.policy == "priority"
                and priority_key(self.waiting.peek()) < priority_key(self.swapped.peek())):
            return self.waiting
        return self.swapped

    def _admit(self, request: Request, step: StepState) -> bool:
        """Give the waiting head its prefix hits and blocks for its first chunk (the
        caller pops it); False when it does not fit."""
        computed_blocks, num_computed_tokens = self._get_computed_blocks(request)
        stored = self._stored_after_hits(request, num_computed_tokens)
        num_external_tokens = len(stored or ()) * self.block_size
        num_computed_tokens += num_external_tokens
        # >= 1: the last token is never a prefix hit.
        num_new_tokens = step.num_tokens_to_schedule(request, num_computed_tokens)
        if num_new_tokens == 0:
            return False
        if self.reserve_full_prompt and not self._prompt_fits(request, computed_blocks, step):
            return False
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_new_tokens, computed_blocks, num_computed_tokens,
            step.num_lookahead(request, num_computed_tokens, num_new_tokens),
            num_external_tokens=num_external_tokens, reserve_blocks=self._reserve(step))
        if new_blocks is None:
            return False
        if stored is not None:
            # The stored blocks are the first new ones (one KV cache group).
            step.kv_loads += self.kv_store.record_loads(request, stored, new_blocks[0])
        request.num_computed_tokens = num_computed_tokens
        request.num_cached_tokens = num_computed_tokens
        self._start_running(request, num_new_tokens, step)
        if step.prompt_blocks_reserved is not None:
            step.prompt_blocks_reserved += self._blocks_to_finish(request)
        return True

    def _prompt_fits(self, request: Request, computed_blocks: GroupBlocks,
                     step: StepState) -> bool:
        """Whether the free blocks hold all of waiting `request`'s prompt (beyond its
        prefix hits) besides what the running requests still need to finish theirs and
        the watermark (`reserve_full_prompt`, vLLM's scheduler_reserve_full_isl).
        Without it a long prompt is admitted for the blocks of its first chunk, and
        prompts admitted side by side preempt each other to finish: each preemption
        recomputes what was prefilled. (vLLM counts only the new prompt; counting the
        running prompts' rest too keeps two long prompts from both being admitted into
        room for one.)"""
        kvm = self.kv_cache_manager
        if step.prompt_blocks_reserved is None:
            step.prompt_blocks_reserved = sum(self._blocks_to_finish(r) for r in self.running)
        # Hits no request holds sit among the free blocks; touching them takes them out.
        num_evictable_hits = sum(1 for group in computed_blocks for b in group
                                 if not b.is_null and b.ref_cnt == 0)
        num_needed = kvm.num_blocks_to_finish(request.num_tokens, computed_blocks,
                                              self.max_num_batched_tokens)
        return (num_needed + step.prompt_blocks_reserved + self._reserve(step)
                <= kvm.get_num_free_blocks() - num_evictable_hits)

    def _blocks_to_finish(self, request: Request) -> int:
        """Blocks running `request` still needs to hold all its tokens (0 once it
        decodes: its next token's block is not reserved)."""
        kvm = self.kv_cache_manager
        return kvm.num_blocks_to_finish(request.num_tokens, kvm.req_to_blocks.get(request.req_id),
                                        self.max_num_batched_tokens)

    def _swap_in(self, request: Request, step: StepState) -> bool:
        """Bring the swapped head back with its num_computed_tokens (the caller pops it);
        False when its blocks plus this step's tokens do not fit the device pool."""
        assert self.swap_space is not None
        # >= 1: a swapped request was running, so a token was waiting for it.
        num_new_tokens = step.num_tokens_to_schedule(request, request.num_computed_tokens)
        if num_new_tokens == 0:
            return False
        pairs = self.swap_space.swap_in(self.kv_cache_manager, request, num_new_tokens,
                                        self._reserve(step))
        if pairs is None:
            return False
        step.blocks_to_swap_in += pairs
        self.num_swaps_in += 1
        self._start_running(request, num_new_tokens, step)
        return True

    def _reserve(self, step: StepState) -> int:
        """Blocks an admission must leave free: the watermark's, once the step runs
        another request (a lone request is never held back by it)."""
        return self.watermark_blocks if step.num_scheduled_tokens else 0

    def _start_running(self, request: Request, num_new_tokens: int,
                       step: StepState) -> None:
        """Put a request that got its blocks into `running` and send it in full."""
        if self.policy == "priority":
            # Nothing is preempted after admission, so inserting mid-list is safe.
            bisect.insort_right(self.running, request, key=priority_key)
        else:
            self.running.append(request)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            # time.monotonic(), as arrival_time (the injectable clock is the deadlines').
            request.first_scheduled_time = time.monotonic()
        step.add_new(request, num_new_tokens,
                     self.kv_cache_manager.get_block_ids(request.req_id))

    def _get_computed_blocks(self, request: Request,
                             ) -> tuple[list[list[KVCacheBlock]], int]:
        """Prefix-cache hits of a waiting request, per KV cache group (none when it
        wants prompt logprobs or mean pooling)."""
        if not may_hit(request):
            return [[] for _ in self.kv_cache_manager.group_windows], 0
        return self.kv_cache_manager.get_computed_blocks(request)

    def _stored_after_hits(self, request: Request, num_hit_tokens: int,
                           ) -> list[bytes] | None:
        """Hashes of the blocks after a waiting request's prefix hits that the KV store
        holds, in order (None: not looked up, as without a store to load from)."""
        store = self.kv_store
        if (store is None or not store.load or not self.kv_cache_manager.enable_caching
                or not may_hit(request)):
            return None
        return store.lookup(request, num_hit_tokens,
                            self.kv_cache_manager.block_hashes(request))

    # ---------------------------------------------------------------- priority, deadlines

    def _preempt_for_waiting_head(self, step: StepState) -> None:
        """Priority policy: preempt worse running requests so the waiting head can start.

        Only while the head has a strictly smaller priority value than the worst running
        request (running[-1]) and cannot be admitted as things stand, and only if
        preempting every worse running request would give it its blocks: otherwise
        preemption could not help and nobody is preempted. Ends: each round preempts one.
        """
        while self.waiting and self.running:
            head = self.waiting.peek()
            if self.running[-1].priority <= head.priority or not self._lora_fits(head):
                return  # (not preempted for a LoRA adapter: it waits for a free one)
            if (len(self.running) < self.max_num_active_seqs
                    and self._fits_after_preempting(head, ())):
                return  # admissible as is
            # running is sorted by priority_key: the worse requests are a suffix (the
            # ones in flight cannot be preempted now).
            worse = [r for r in self.running if r.priority > head.priority]
            if not all(r.req_id not in self.in_flight for r in worse):
                # Async scheduling: preempt once they are back (the next schedule).
                self._victims_in_flight = True
                worse = [r for r in worse if r.req_id not in self.in_flight]
            if not worse or not self._fits_after_preempting(head, worse):
                return
            self._preempt(self.running.pop(self.running.index(worse[-1])), step)

    def _fits_after_preempting(self, request: Request, victims: Sequence[Request]) -> bool:
        """Whether the pool could hold the uncached part of waiting `request` once every
        request in `victims` were preempted (either mode frees the same device blocks),
        with the watermark's blocks to spare while running requests remain."""
        computed_blocks, _ = self._get_computed_blocks(request)
        reserve = self.watermark_blocks if len(victims) < len(self.running) else 0
        if self.reserve_full_prompt:  # (as _prompt_fits: the rest of the others' prompts)
            reserve += sum(self._blocks_to_finish(r) for r in self.running
                           if r not in victims)
        return self.kv_cache_manager.fits_after_freeing(
            request.num_tokens, computed_blocks, [r.req_id for r in victims], reserve)

    def _finish_expired_requests(self) -> None:
        """Finish every live request whose deadline is <= now as FINISHED_TIMEOUT."""
        if not self._deadlines:
            return  # no request has a deadline: not even a clock read
        expired = self._deadlines.pop_expired(self.clock(), self.requests)
        if expired:
            self.timed_out_reqs += self.finish_requests(expired,
                                                        RequestStatus.FINISHED_TIMEOUT)
        self._deadlines.compact(self.requests)

    # ---------------------------------------------------------------- update

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens, apply stop conditions, free finished requests
        (core/output_update.py).

        Returns the requests that got new tokens or finished in this step, in the
        runner's order, then those that only got prompt logprobs. Requests finished or
        aborted meanwhile are skipped.
        """
        # Counter subtraction drops the ids whose count reaches 0.
        self.in_flight -= Counter(scheduler_output.num_scheduled_tokens.keys())
        # Requests whose blocks failed to load: failed, or back in waiting (either way
        # not RUNNING, so what they sampled this step is dropped below).
        failed = (self._handle_kv_load_failures(model_runner_output.kv_load_failures)
                  if model_runner_output.kv_load_failures else [])
        if self.async_scheduling:
            # The tokens of this step's placeholders are here (applied below).
            for req_id, token_ids in zip(model_runner_output.req_ids,
                                         model_runner_output.sampled_token_ids):
                request = self.requests.get(req_id)
                if token_ids and request is not None and request.num_output_placeholders:
                    request.num_output_placeholders -= 1
        update = apply_runner_output(self.requests, scheduler_output, model_runner_output,
                                     self.max_num_tokens)
        self.num_draft_tokens += update.num_draft_tokens
        self.num_accepted_tokens += update.num_accepted_tokens
        if update.finished:
            for request in update.finished:
                self._free_request(request)
            finished = {r.req_id for r in update.finished}
            self.running = [r for r in self.running if r.req_id not in finished]
        return failed + update.updated

    def _handle_kv_load_failures(self, failures: dict[int, str]) -> list[Request]:
        """Blocks the runner could not fill from the KV store (block id -> why): they
        leave the prefix cache (and the store's lookups), and every request holding one
        is recomputed or failed (kv_load_failure_policy). Returns the failed ones."""
        kv = self.kv_cache_manager
        self.kv_store.num_load_failures += len(failures)
        blocks = [kv.block_pool.blocks[block_id] for block_id in failures]
        self.kv_store.forget([b.block_hash for b in blocks if b.block_hash is not None])
        kv.block_pool.forget(blocks)
        bad = set(failures)
        why: dict[str, str] = {}
        for request in self.running:
            ids = [b.block_id for b in kv.get_blocks(request.req_id) if b.block_id in bad]
            if ids:
                why[request.req_id] = f"KV cache load failed: {failures[ids[0]]}"
        failed = []
        for req_id, message in why.items():
            request = self.requests[req_id]
            if self.kv_load_failure_policy == "recompute" and req_id not in self.in_flight:
                self.running.remove(request)
                self._preempt(request, None)
            else:
                failed += self.fail_requests({req_id: message}, invalid=False)
        return failed

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
            if request is not None and not request.is_finished:
                finished += self._finish_one(request, status)
        return finished

    def _finish_one(self, request: Request, status: RequestStatus,
                    forget: bool = False) -> list[Request]:
        """Take a live request out of its queue, set `status`, free it; [request]."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif self.held is not None and request.req_id in self.held:
            del self.held[request.req_id]
        else:
            self.waiting.remove(request)
        request.status = status
        self._free_request(request, forget=forget)
        return [request]

    def fail_requests(self, failures: dict[str, str], invalid: bool = True,
                      ) -> list[Request]:
        """Finish live requests the runner could not run as asked (req_id -> why, in
        `Request.error`; `invalid`: the request's fault, else the server's) as aborted.
        Their blocks leave the prefix cache: the KV they computed may not be what their
        hashes promise (a LoRA adapter that failed to load ran as the base model).
        Unknown or finished ids are ignored."""
        failed = []
        for req_id, why in failures.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            request.error = why
            request.error_is_invalid = invalid
            failed += self._finish_one(request, RequestStatus.FINISHED_ABORTED, forget=True)
        return failed

    def _free_request(self, request: Request, forget: bool = False) -> None:
        """Release a finished request's blocks, device and host, and forget it (status
        already set); `forget`: its blocks leave the prefix cache too."""
        self.kv_cache_manager.free(request, forget=forget)
        if self.swap_space is not None:
            self.swap_space.free(request)
        self._num_needing_host_tokens -= needs_host_tokens(request)
        del self.requests[request.req_id]
        self.finished_req_ids.add(request.req_id)


def may_hit(request: Request) -> bool:
    """Whether a request may start from cached K/V: not when it wants prompt logprobs
    (the logits of every prompt position) or mean pooling (their hidden states)."""
    return not (request.sampling_params.prompt_logprobs is not None
                or (request.is_pooling and request.pooling_params.needs_all_positions))


def needs_host_tokens(request: Request) -> bool:
    """Whether sampling or scheduling the request's next token reads its previous token
    on the host (see Scheduler.can_overlap)."""
    sp = request.sampling_params
    return bool(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1
                or sp.bad_words or sp.bad_words_token_ids or sp.min_tokens
                or sp.structured_outputs is not None or sp.thinking_token_budget is not None)
