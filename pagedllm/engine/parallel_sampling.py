"""Parallel sampling (n > 1, best_of): one prompt fans out into one request per sample.

The children are ordinary engine requests with ids "{request_id}_{i}"; they share the
prompt's KV blocks through the prefix cache (EngineCore.add_requests admits the first
child alone and the others once its prompt is computed). The OutputProcessor folds
them back into one RequestOutput.
"""

from __future__ import annotations

import copy

from pagedllm.request import Request, RequestStatus


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}_{index}"


def fan_out(request: Request) -> list[Request]:
    """The engine requests of a user request: itself when it wants one sample.

    Children keep the parent's arrival_time, priority and deadline. Child i gets n = 1
    and, when the parent is seeded, seed + i (distinct samples that are still
    reproducible). Only child 0 computes prompt logprobs (they would force the others to
    skip the prefix cache). best_of > n ranks by cumulative logprob, so the children then
    compute at least the chosen token's logprob.
    """
    sp = request.sampling_params
    num_samples = sp.num_samples
    if num_samples == 1:
        return [request]
    children = []
    for i in range(num_samples):
        params = sp.clone()
        params.n, params.best_of = 1, None
        if sp.seed is not None:
            params.seed = sp.seed + i
        if i > 0:
            params.prompt_logprobs = None
        if num_samples > sp.n and params.logprobs is None:
            params.logprobs = 0
        child = Request(child_request_id(request.req_id, i), request.prompt_token_ids,
                        params, request.eos_token_id, request.arrival_time,
                        request.priority, max_tokens=request.max_tokens,
                        deadline=request.deadline, lora_request=request.lora_request,
                        mm_inputs=request.mm_inputs, cache_salt=request.cache_salt)
        # Each sample reads its own output: a gate of its own, at the prompt's phase.
        child.reasoning_gate = copy.copy(request.reasoning_gate)
        children.append(child)
    return children


class DeferredSiblings:
    """Children 1.. of each fan-out, held back until child 0 has its first token.

    By then child 0's prompt is computed and its full blocks are in the prefix cache,
    so the siblings, admitted next, compute only the last partial block instead of the
    whole prompt. (Admitted together, they would all miss the cache in the same step.)
    Works over the in-process EngineCore and the engine-core client alike: it only
    reads the leader's output tokens and status.
    """

    def __init__(self) -> None:
        self.groups: list[tuple[Request, list[Request]]] = []

    def __len__(self) -> int:
        return sum(len(rest) for _, rest in self.groups)

    def add(self, leader: Request, rest: list[Request]) -> None:
        if rest:
            self.groups.append((leader, rest))

    def release(self) -> list[tuple[Request, str]]:
        """The held requests whose leader has a token (or finished), in fan-out order,
        each with its leader's id."""
        ready: list[tuple[Request, str]] = []
        waiting = []
        for leader, rest in self.groups:
            if leader.num_output_tokens > 0 or leader.is_finished:
                ready.extend((child, leader.req_id) for child in rest)
            else:
                waiting.append((leader, rest))
        self.groups = waiting
        return ready

    def abort(self, req_ids: set[str]) -> list[Request]:
        """Drop held requests in `req_ids`; they come back marked aborted."""
        aborted: list[Request] = []
        groups = []
        for leader, rest in self.groups:
            keep = [r for r in rest if r.req_id not in req_ids]
            aborted.extend(r for r in rest if r.req_id in req_ids)
            if keep:
                groups.append((leader, keep))
        self.groups = groups
        for request in aborted:
            request.status = RequestStatus.FINISHED_ABORTED
        return aborted
