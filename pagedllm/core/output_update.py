"""Applying one step's `ModelRunnerOutput` to its requests: tokens, stops, drafts.

The runner returns, per request, the tokens it sampled (or a pooled vector, or a chunk
of prompt logprobs). `apply_runner_output` appends them, takes back the K/V of rejected
drafts and applies the stop conditions; it reports which requests finished, and
`Scheduler.update_from_output` frees them and drops them from `running`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedllm.request import Request, RequestStatus


@dataclass
class OutputUpdate:
    """What applying one `ModelRunnerOutput` did."""

    # Requests that got new tokens or finished, in the runner's order (pooled first),
    # then those that only got prompt logprobs (a prefill chunk).
    updated: list[Request] = field(default_factory=list)
    # The updated requests that finished, in the same order (their blocks to free).
    finished: list[Request] = field(default_factory=list)
    # Proposed tokens this step verified, and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def apply_runner_output(requests: Mapping[str, Request], scheduler_output: SchedulerOutput,
                        model_runner_output: ModelRunnerOutput,
                        max_num_tokens: int) -> OutputUpdate:
    """Append sampled tokens and apply stop conditions to the live, RUNNING `requests`
    named in the output; requests finished or aborted meanwhile are skipped.

    `max_num_tokens` is the longest sequence a request may reach (FINISHED_LENGTH).
    Finished requests get their FINISHED_* status here; freeing them is the caller's.
    """
    update = OutputUpdate()
    scored = _record_prompt_logprobs(requests, model_runner_output)
    _finish_pooled(requests, model_runner_output, update)
    all_logprobs = model_runner_output.logprobs
    spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
    for i, (req_id, token_ids) in enumerate(zip(model_runner_output.req_ids,
                                                model_runner_output.sampled_token_ids)):
        request = requests.get(req_id)
        if request is None or request.status != RequestStatus.RUNNING or not token_ids:
            continue  # unknown/aborted, or a partial prefill that sampled nothing
        if req_id in spec_scheduled:
            # The runner emitted the accepted drafts plus one token of its own: the
            # K/V written for the rejected drafts is not the sequence's.
            num_drafts = len(spec_scheduled[req_id])
            num_accepted = len(token_ids) - 1
            request.num_computed_tokens -= num_drafts - num_accepted
            update.num_draft_tokens += num_drafts
            update.num_accepted_tokens += num_accepted
        logprobs = all_logprobs[i] if all_logprobs is not None else None
        for j, token_id in enumerate(token_ids):
            request.append_output_token_ids([token_id])
            if logprobs:
                request.output_logprobs.append(logprobs[j])
            if check_stop(request, token_id, max_num_tokens):
                break  # tokens after the stop point are dropped
        update.updated.append(request)
        if request.is_finished:
            update.finished.append(request)
    # A prefill chunk that scored prompt logprobs: the front end converts them as they
    # come (a long prompt's all at once would stall it), so they are reported now.
    if scored:
        reported = {request.req_id for request in update.updated}
        update.updated += [request for request in scored if request.req_id not in reported]
    for req_id, spec in (model_runner_output.spec_token_ids or {}).items():
        request = requests.get(req_id)
        if request is not None and request.status == RequestStatus.RUNNING:
            request.spec_token_ids = spec
    return update


def check_stop(request: Request, token_id: int, max_num_tokens: int) -> bool:
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
            or request.num_tokens >= max_num_tokens):
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def _finish_pooled(requests: Mapping[str, Request], model_runner_output: ModelRunnerOutput,
                   update: OutputUpdate) -> None:
    """Embedding requests whose pooled vector arrived: store it and finish them as
    FINISHED_STOPPED (they never sample)."""
    for req_id, vector in (model_runner_output.pooler_output or {}).items():
        request = requests.get(req_id)
        if request is None or request.status != RequestStatus.RUNNING:
            continue  # aborted meanwhile
        request.pooler_output = vector
        request.status = RequestStatus.FINISHED_STOPPED
        update.updated.append(request)
        update.finished.append(request)


def _record_prompt_logprobs(requests: Mapping[str, Request],
                            model_runner_output: ModelRunnerOutput) -> list[Request]:
    """Add each chunk to its request; the requests that got one."""
    scored = []
    for req_id, chunk in (model_runner_output.prompt_logprobs or {}).items():
        request = requests.get(req_id)
        if request is not None and request.status == RequestStatus.RUNNING:
            request.add_prompt_logprobs(chunk)
            scored.append(request)
    return scored
