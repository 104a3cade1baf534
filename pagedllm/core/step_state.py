"""One step's token budget: what a `schedule()` call has decided so far, how many
tokens a request may take of what is left, and the `SchedulerOutput` it becomes."""

from __future__ import annotations

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
    # req_id -> proposed tokens scheduled after the request's last token.
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # A running request could not get its blocks (set by _allocate_or_preempt, not by
    # preemptions that make room for a better waiting request).
    is_short_of_blocks: bool = False

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.num_scheduled_tokens[request.req_id] = num_new_tokens
        self.token_budget -= num_new_tokens

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
            pooling_params=request.pooling_params))
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
        """Tokens after `num_computed_tokens`, capped by the budget (chunked prefill);
        0 when they must all fit one step and do not (no chunked prefill, or an
        embedding request: it pools its whole prompt in one step)."""
        num_new_tokens = request.num_tokens - num_computed_tokens
        if num_new_tokens > self.token_budget:
            if not self.enable_chunked_prefill or request.is_pooling:
                return 0  # the whole prompt must fit one step
            num_new_tokens = self.token_budget
        return num_new_tokens

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
        )
