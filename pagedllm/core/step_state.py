"""One step's token budget: what a `schedule()` call has decided so far, how many
tokens a request may take of what is left, and the `SchedulerOutput` it becomes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.contracts import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.request import Request


@dataclass
class StepState:
    """What one `schedule()` call has decided so far, and the limits it decides within
    (the scheduler's, read when the step starts)."""

    # Tokens left in this step's budget.
    token_budget: int
    # The longest sequence a request may reach (Scheduler.max_num_tokens).
    max_num_tokens: int
    enable_chunked_prefill: bool
    # Slots reserved past the tokens of a step that samples (draft model K/V).
    num_lookahead_tokens: int = 0
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    # (device, host) block pairs of this step's swap-outs, (host, device) of swap-ins.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # KV store transfers (core/kv_store.py): (file stem, block id) loads, (block id,
    # file stem) saves; host slots for file stems with the host tier (core/kv_offload.py).
    kv_loads: list[tuple[str | int, int]] = field(default_factory=list)
    kv_saves: list[tuple[int, str | int]] = field(default_factory=list)
    # req_id -> proposed tokens scheduled after the request's last token.
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # A running request could not get its blocks (set by _allocate_or_preempt, not by
    # preemptions that make room for a better waiting request).
    is_short_of_blocks: bool = False
    # SchedulerConfig.attention_pairs_per_token (0: prefill chunks cost their tokens).
    attention_pairs_per_token: int = 0
    # SchedulerConfig.prompt_logprob_cost: what scoring a prompt position costs on top.
    prompt_logprob_cost: float = 0.0
    # SchedulerConfig.long_prefill_token_threshold: most tokens of one prompt a step
    # takes (0: no cap).
    long_prefill_token_threshold: int = 0
    # Blocks the running requests still need to finish their prompts (the scheduler's
    # `_prompt_fits`; None until an admission asks).
    prompt_blocks_reserved: int | None = None

    def __post_init__(self) -> None:
        # What the step's prefill chunks may cost, in tokens: as much as a fresh prompt
        # of the whole budget (see chunk_cost).
        self.cost_left = (self.chunk_cost(0, self.token_budget)
                          if self.attention_pairs_per_token else math.inf)

    def chunk_cost(self, num_computed: int, num_new_tokens: int,
                   scored: bool = False) -> float:
        """Cost, in tokens through the linear layers, of prefilling tokens [num_computed,
        num_computed + num_new_tokens): each also attends to ~num_computed + n / 2 keys
        at 1 / attention_pairs_per_token of a token each, and, `scored` (the request
        wants prompt logprobs), gets its row of logits scored at prompt_logprob_cost."""
        r = self.attention_pairs_per_token
        return num_new_tokens * (1 + self._scoring(scored)
                                 + (num_computed + num_new_tokens / 2) / r)

    def _scoring(self, scored: bool) -> float:
        return self.prompt_logprob_cost if scored else 0.0

    def cap_chunk(self, request: Request, num_computed: int, num_new_tokens: int) -> int:
        """A prefill chunk (more than one token) cut to long_prefill_token_threshold and
        to what is left of the step's cost budget, down to one token at least; decodes,
        and prompts that must fit one step (no chunked prefill, embeddings), are left as
        they are."""
        if num_new_tokens <= 1 or not self.enable_chunked_prefill or request.is_pooling:
            return num_new_tokens
        if 0 < self.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = self.long_prefill_token_threshold
        if math.isinf(self.cost_left):
            return num_new_tokens
        # The largest n with chunk_cost(num_computed, n) <= cost_left: the root of
        # n^2 / 2r + a n - cost_left with a = 1 + scoring + num_computed / r.
        r = self.attention_pairs_per_token
        a = 1 + self._scoring(scores_prompt(request)) + num_computed / r
        fits = r * (math.sqrt(a * a + 2 * max(self.cost_left, 0) / r) - a)
        return max(1, min(num_new_tokens, int(fits)))

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.num_scheduled_tokens[request.req_id] = num_new_tokens
        self.token_budget -= num_new_tokens
        if num_new_tokens > 1 and not math.isinf(self.cost_left):
            self.cost_left -= self.chunk_cost(request.num_computed_tokens, num_new_tokens,
                                              scores_prompt(request))

    def add_new(self, request: Request, num_new_tokens: int,
                block_ids: list[list[int]]) -> None:
        """Schedule a request that starts running (admitted or swapped in): it is sent
        to the runner in full."""
        self.new_reqs.append(NewRequestData(
            req_id=request.req_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            eos_token_id=request.eos_token_id,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
            mm_inputs=request.mm_inputs))
        self.add(request, num_new_tokens)

    def add_cached(self, request: Request, num_new_tokens: int,
                   new_blocks: list[list[KVCacheBlock]], new_token_ids: list[int]) -> None:
        """Schedule a request that continues running: only what changed is sent."""
        self.cached_reqs.append(CachedRequestData(
            req_id=request.req_id,
            new_block_ids=[[b.block_id for b in group] for group in new_blocks],
            num_computed_tokens=request.num_computed_tokens,
            new_token_ids=new_token_ids))
        self.add(request, num_new_tokens)

    def num_tokens_to_schedule(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after `num_computed_tokens`, capped by the budget and the cost budget
        (chunked prefill); 0 when they must all fit one step and do not (no chunked
        prefill, or an embedding request: it pools its whole prompt in one step)."""
        num_new_tokens = request.num_tokens - num_computed_tokens
        if num_new_tokens > self.token_budget:
            if not self.enable_chunked_prefill or request.is_pooling:
                return 0  # the whole prompt must fit one step
            num_new_tokens = self.token_budget
        return self.cap_chunk(request, num_computed_tokens, num_new_tokens)

    def spec_tokens_to_schedule(self, request: Request) -> list[int]:
        """The request's proposed tokens this step verifies (consumed either way): only
        when decoding (one token left to compute), capped so the budget holds them and
        the tokens it may emit (k + 1) stay within max_tokens and the longest sequence."""
        spec = request.spec_token_ids
        if not spec:
            return spec  # the common case: nothing proposed, nothing allocated per step
        request.spec_token_ids = []
        if request.num_tokens - request.num_computed_tokens != 1:
            return []
        num_spec = min(len(spec), self.token_budget - 1,
                       self.max_num_tokens - request.num_tokens - 1)
        if request.max_tokens is not None:
            num_spec = min(num_spec, request.max_tokens - request.num_output_tokens - 1)
        return spec[:max(num_spec, 0)]

    def num_lookahead(self, request: Request, num_computed_tokens: int,
                      num_new_tokens: int) -> int:
        """Slots to reserve past this step's tokens: num_lookahead_tokens when the step
        samples for the request (its tokens are all computed after it), within the
        longest sequence; 0 otherwise."""
        if (not self.num_lookahead_tokens or request.is_pooling
                or num_computed_tokens + num_new_tokens < request.num_tokens):
            return 0
        room = self.max_num_tokens - (num_computed_tokens + num_new_tokens)
        return max(0, min(self.num_lookahead_tokens, room))

    def to_output(self, finished_req_ids: set[str]) -> SchedulerOutput:
        """The step's `SchedulerOutput` (its lists and dicts, not copies)."""
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=self.cached_reqs,
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            blocks_to_swap_out=self.blocks_to_swap_out,
            blocks_to_swap_in=self.blocks_to_swap_in,
            scheduled_spec_decode_tokens=self.spec_tokens,
            kv_blocks_to_load=self.kv_loads,
            kv_blocks_to_save=self.kv_saves,
        )


def scores_prompt(request: Request) -> bool:
    """Whether the request's prefill scores its prompt positions (prompt logprobs)."""
    return not request.is_pooling and request.sampling_params.prompt_logprobs is not None
