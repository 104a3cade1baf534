"""The only types that cross between the scheduler and the model runner.

Plain dataclasses of ints, lists and dicts (no tensors; numpy arrays only for the grammar
bitmask and a new request's image pixels or prompt embeddings), so the runner can live
in another process. A request's full data is sent once (`NewRequestData`); later steps
send only what changed (`CachedRequestData`). The runner appends the tokens it samples
to its own copy of each request, so sampled ids never travel back down, except under
pipeline parallelism, where only the last stage samples and steps overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The logprob records are defined beside Request, which stores them, so that request.py
# never imports core/; the runner returns them through ModelRunnerOutput.
from pagedllm.lora_request import LoRARequest
from pagedllm.mm_inputs import PromptInput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import PromptLogprobsChunk, TokenLogprobs
from pagedllm.sampling_params import SamplingParams

__all__ = ["CachedRequestData", "EMPTY_MODEL_RUNNER_OUTPUT", "ModelRunnerOutput",
           "NewRequestData", "PromptLogprobsChunk", "SchedulerOutput", "TokenLogprobs"]


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption: recomputed like prompt tokens after a
    # recompute preemption; already in the cache (num_computed_tokens) after a swap-in.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # Physical KV block ids per KV cache group (core/kv_groups.py; one group unless the
    # model has sliding windows), in logical order: block i holds positions
    # [i*B, (i+1)*B); 0 (the null block) where a window group gave a block back.
    block_ids: list[list[int]]
    # Tokens whose K/V is already in the cache before this step (prefix-cache hits, or
    # everything computed before a swap-out when the request is swapped back in).
    num_computed_tokens: int
    # EOS id masked by min_tokens (None: the tokenizer has none).
    eos_token_id: int | None = None
    # Embedding requests only: how to pool the final hidden states of the prompt (its
    # whole prompt is scheduled in this one step; nothing is sampled for it).
    pooling_params: PoolingParams | None = None
    # The LoRA adapter it runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # Its prompt's images (multimodal models), or its prompt embeddings: the runner
    # puts their rows in place of the token embeddings of the positions a step computes
    # (encoding an image's first).
    mm_inputs: list[PromptInput] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """A request the runner already holds, continuing this step."""

    req_id: str
    # Per KV cache group: blocks appended to the request's block table this step (often
    # empty when decoding; 0 for positions a window group already left behind). A
    # window group's older blocks become 0 in the table by its window (the runner
    # applies the scheduler's rule, core/kv_groups.num_skipped_blocks).
    new_block_ids: list[list[int]]
    # Tokens with K/V in the cache before this step.
    num_computed_tokens: int
    # Under pipeline parallelism only: the token sampled for it since it last ran (the
    # runners of a pipeline do not see each other's samples); [] otherwise.
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What to run in one forward pass."""

    # Requests sent in full, in scheduling order.
    scheduled_new_reqs: list[NewRequestData]
    # Requests the runner already holds, in scheduling order.
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step (1 for a decode, a chunk for a prefill).
    num_scheduled_tokens: dict[str, int]
    # Sum of num_scheduled_tokens.
    total_num_scheduled_tokens: int
    # Requests finished or aborted since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted since the last step (recomputed or swapped out): the runner
    # drops their state; they come back later as NewRequestData, with their generated
    # tokens to recompute, or (swapped in) with their K/V restored.
    preempted_req_ids: set[str] = field(default_factory=set)
    # (device block id, host block id): copy device -> host before this step's forward
    # pass (swap preemption). The device block may be reused by this very step.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (host block id, device block id): copy host -> device before the forward pass,
    # after every swap-out of the step (a device block freed by a swap-out of this step
    # may be the destination of a swap-in).
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # KV blocks shared with other engines (core/kv_store.py): (file stem, block id) to
    # read into the cache before the forward pass, after the swaps (blocks a newly
    # admitted request found in the store), and (block id, file stem) to write after it
    # (prompt blocks this step completes). With the prefix cache's host tier instead
    # (core/kv_offload.py) the same, with host slots for file stems (and every full
    # block this step completes saved).
    kv_blocks_to_load: list[tuple[str | int, int]] = field(default_factory=list)
    kv_blocks_to_save: list[tuple[int, str | int]] = field(default_factory=list)
    # Speculative decoding: req_id -> the proposed tokens this step verifies after the
    # request's last token (its num_scheduled_tokens count them: 1 + len(drafts)).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Structured output (filled by the engine core after scheduling): req_id -> row of
    # `grammar_bitmask` for each request of the step that samples under a grammar; the
    # bitmask is xgrammar's allowed-token mask, a numpy int32 array [rows, ceil(V / 32)]
    # (bit j of a row set: token j allowed). None when no request of the step has one.
    structured_output_rows: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced."""

    # Requests of the step, in the runner's order.
    req_ids: list[str]
    # Per request: the sampled token ids ([] while its prompt is still being prefilled).
    sampled_token_ids: list[list[int]]
    # Per request, one entry per sampled token ([] for requests that did not ask);
    # None when no request of the step asked for logprobs.
    logprobs: list[list[TokenLogprobs]] | None = None
    # req_id -> prompt logprobs of the prompt tokens scored this step (prompt_logprobs
    # requests only; None when there are none).
    prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None
    # req_id -> pooled (float32, normalized when asked) hidden states of the embedding
    # requests of the step (None when there are none).
    pooler_output: dict[str, list[float]] | None = None
    # Speculative decoding: req_id -> tokens proposed to follow what it has now (verified
    # by the next step that schedules it); None when nothing was proposed.
    spec_token_ids: dict[str, list[int]] | None = None
    # req_id -> why the runner could not run it as asked (its LoRA adapter failed to
    # load); the engine fails these requests and drops what they sampled. None: none.
    failed_requests: dict[str, str] | None = None
    # req_id -> how code the engine ran for it failed (a custom logits processor raised):
    # failed as above, but answered as a server error, not a bad request. None: none.
    errored_requests: dict[str, str] | None = None
    # block id -> why the block could not be loaded from the KV store (any tensor
    # parallel rank's file); the engine fails or recomputes the requests holding it.
    # None: every load of the step succeeded (or there were none).
    kv_load_failures: dict[int, str] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
