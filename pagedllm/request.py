"""Request: the scheduler's view of one sequence being generated, and the logprob
records it accumulates (the runner reports them through core/contracts.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.lora_request import LoRARequest
from pagedllm.mm_inputs import PromptEmbedsInput, PromptInput
from pagedllm.reasoning import ReasoningGate
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # Preempted with its K/V copied to host blocks (preemption_mode "swap"): waits in the
    # scheduler's swapped queue and resumes without recomputation.
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_TIMEOUT = "finished_timeout"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
}


@dataclass
class TokenLogprobs:
    """Logprobs of one token position, as the model runner reports them: the chosen (or
    actual prompt) token first, then the top-k of the model's raw log-softmax.

    The output processor turns a list of these into `outputs.SampleLogprobs` (one
    {token_id: Logprob} dict per position), the form users see.
    """

    # [chosen, top1, top2, ...]
    token_ids: list[int]
    logprobs: list[float]
    # Rank of each entry in the full distribution: 1 + the number of vocabulary entries
    # with a strictly larger logprob (ties share a rank; the argmax is always 1).
    ranks: list[int]


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs of the prompt positions one step computed (chunked prefill)."""

    # Prompt index of the token the first entry scores (>= 1: token 0 has no logprob).
    start: int
    # One entry per prompt token start, start + 1, ...
    entries: list[TokenLogprobs]


class Request:
    """One sequence: its prompt, its generated tokens and how far its KV is computed.

    `num_computed_tokens` counts tokens whose K/V is in the cache (or scheduled to be
    written this step); tokens `[num_computed_tokens, num_tokens)` still need a forward
    pass. After a recompute preemption it drops to 0 and the prompt plus outputs are
    recomputed; a swapped-out request keeps it (its K/V waits in host blocks).
    `priority` orders requests under the "priority" scheduling policy (lower runs first);
    `deadline` is an absolute `time.monotonic()` time at which the scheduler finishes the
    request as FINISHED_TIMEOUT (None: no deadline).
    A request with `pooling_params` is an embedding request: prefill only, its whole
    prompt in one step, finished (FINISHED_STOPPED) once the runner's pooled vector is
    in `pooler_output`; its `sampling_params` are a placeholder nothing samples with.
    """

    def __init__(self, req_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_id: int | None,
                 arrival_time: float | None = None, priority: int = 0,
                 max_tokens: int | None = None, deadline: float | None = None,
                 pooling_params: PoolingParams | None = None,
                 lora_request: LoRARequest | None = None,
                 mm_inputs: list[PromptInput] | None = None,
                 cache_salt: str | None = None) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.deadline = deadline
        # Resolved output cap: SamplingParams.max_tokens, or what max_model_len leaves.
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens served from the prefix cache at the latest admission (for stats).
        self.num_cached_tokens = 0
        # time.monotonic() of its first admission (None until then): its queue time ends.
        self.first_scheduled_time: float | None = None
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Hashes of this request's full blocks, extended lazily by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # Logprobs of the output tokens (logprobs requests only) not yet taken by their
        # reader (`take_output_logprobs`: the core's sender, or the output processor),
        # in order: the last len(output_logprobs) output tokens' when none is pending.
        self.output_logprobs: list[TokenLogprobs] = []
        # Logprobs of prompt tokens 1.. (prompt_logprobs requests only); entry i scores
        # prompt token i + 1. Filled chunk by chunk as the prompt is prefilled.
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.pooling_params = pooling_params
        # The LoRA adapter the model runs with for this request (None: the base model).
        self.lora_request = lora_request
        # Its prompt's prefix-cache salt (vLLM's cache_salt): only requests with the
        # same salt share cached blocks.
        self.cache_salt = cache_salt
        # Images of a multimodal prompt, in prompt order, or the prompt's embeddings
        # (one PromptEmbedsInput over the whole prompt); [] for text.
        self.mm_inputs: list[PromptInput] = list(mm_inputs or ())
        # The pooled vector (embedding requests only): [] until the pooling step.
        self.pooler_output: list[float] = []
        # Speculative decoding: tokens proposed to follow all_token_ids, to be verified
        # by the next step that schedules this request (never part of its tokens).
        self.spec_token_ids: list[int] = []
        # Async scheduling: tokens sampled in steps whose output has not come back yet
        # (their positions are scheduled already; the runner fills them on the device).
        self.num_output_placeholders = 0
        # Structured output: the xgrammar matcher of its grammar, advanced by each output
        # token (set by the engine core once the grammar compiled; None otherwise).
        self.structured_output: Any = None
        # With a reasoning parser: where its output stands (reasoning or answer), read
        # token by token; its grammar constrains only the answer. None otherwise.
        self.reasoning_gate: ReasoningGate | None = None
        # Why the engine finished it as aborted when it could not run it (its grammar did
        # not compile within the limits): the front end answers it as an error. None
        # otherwise.
        self.error: str | None = None
        # False when the fault was the server's (a custom logits processor raised): the
        # front end answers with a server error instead.
        self.error_is_invalid = True

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 without one."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def block_hash_extra_keys(self) -> tuple[Any, ...] | None:
        """What its prefix-cache block hashes add to the tokens: the adapter's id (KV
        computed under one adapter is not another's, nor the base model's) and its
        cache salt (blocks are chained, so every block of a salted prompt differs from
        an unsalted one's; a tenant cannot time another's prefixes)."""
        keys: tuple[Any, ...] = (self.lora_int_id,) if self.lora_request is not None else ()
        if self.cache_salt is not None:
            keys += (("cache_salt", self.cache_salt),)
        return keys or None

    @property
    def has_prompt_embeds(self) -> bool:
        """Whether its prompt came as embeddings (its token ids are placeholders)."""
        return any(isinstance(x, PromptEmbedsInput) for x in self.mm_inputs)

    def image_hashes(self, start: int, end: int) -> tuple[str, ...]:
        """Hashes of its images (or prompt embeddings) with a position in [start, end):
        a block's K/V there depends on the pixels (rows), not only on the placeholder
        ids."""
        return tuple(image.hash for image in self.mm_inputs if image.overlaps(start, end))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def take_output_logprobs(self) -> list[TokenLogprobs]:
        """The output logprobs added since the last call (each is read once: kept, the
        entries of 128 samples of 8,000 tokens at 20 logprobs were 2 GB per process)."""
        taken, self.output_logprobs = self.output_logprobs, []
        return taken

    def add_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """Record a chunk of prompt logprobs; entries already held (a prompt recomputed
        after preemption) are skipped, so each prompt token is scored once."""
        # Entry i of self.prompt_logprobs scores prompt token i + 1.
        skip = len(self.prompt_logprobs) - (chunk.start - 1)
        if skip >= 0:
            self.prompt_logprobs.extend(chunk.entries[skip:])

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, status={self.status.value}, "
                f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
