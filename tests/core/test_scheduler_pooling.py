"""Embedding (pooling) requests in the scheduler: whole prompt in one step, never
chunked, finished by their pooled output, no prefix hits under mean pooling."""

from __future__ import annotations

import pytest

from pagedllm.core.contracts import ModelRunnerOutput
from pagedllm.errors import InvalidRequestError
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams


def pooled(req_id: str, n: int, pooling_type: str = "last", start: int = 0) -> Request:
    return Request(req_id, list(range(start, start + n)), SamplingParams(max_tokens=1),
                   eos_token_id=None, max_tokens=1,
                   pooling_params=PoolingParams(pooling_type=pooling_type))


def run_pooled_step(sched, vectors: dict[str, list[float]] | None = None):
    """Schedule, then answer like the runner: [] tokens for embedding requests plus
    their vectors, token 0 for finished prefills of generate requests."""
    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled, pooler = [], {}
    for req_id in req_ids:
        req = sched.requests[req_id]
        if req.is_pooling:
            sampled.append([])
            pooler[req_id] = (vectors or {}).get(req_id, [1.0, 0.0])
        else:
            sampled.append([0] if req.num_computed_tokens >= req.num_tokens else [])
    runner = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                               pooler_output=pooler or None)
    return out, sched.update_from_output(out, runner)


def test_pooled_request_runs_once_and_finishes(make_scheduler, make_request) -> None:
    sched = make_scheduler(num_blocks=10, block_size=4)
    sched.add_request(pooled("e", 10))
    sched.add_request(make_request("g", list(range(100, 105)), max_tokens=3))
    out, updated = run_pooled_step(sched, {"e": [0.6, 0.8]})
    assert out.num_scheduled_tokens == {"e": 10, "g": 5}
    assert out.scheduled_new_reqs[0].pooling_params == PoolingParams(pooling_type="last")
    assert out.scheduled_new_reqs[1].pooling_params is None
    emb = next(r for r in updated if r.req_id == "e")
    assert emb.status == RequestStatus.FINISHED_STOPPED
    assert emb.pooler_output == [0.6, 0.8] and emb.output_token_ids == []
    assert "e" not in sched.requests and [r.req_id for r in sched.running] == ["g"]
    # Its blocks are back: only "g" (5 tokens -> 2 blocks) holds any.
    assert sched.kv_cache_manager.get_num_free_blocks() == 9 - 2
    out, _ = run_pooled_step(sched)
    assert out.finished_req_ids == {"e"}


def test_pooled_prompt_is_never_chunked(make_scheduler, make_request) -> None:
    sched = make_scheduler(num_blocks=20, max_num_batched_tokens=16)
    sched.add_request(make_request("g", list(range(100, 110)), max_tokens=4))
    sched.add_request(pooled("e", 12))
    # 10 + 12 > 16: a generate prompt would be chunked; the embedding waits instead.
    out, _ = run_pooled_step(sched)
    assert out.num_scheduled_tokens == {"g": 10}
    out, updated = run_pooled_step(sched)
    assert out.num_scheduled_tokens == {"g": 1, "e": 12}
    assert any(r.req_id == "e" and r.is_finished for r in updated)


def test_pooled_prompt_over_the_step_budget_is_rejected(make_scheduler) -> None:
    sched = make_scheduler(num_blocks=40, max_num_batched_tokens=16)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        sched.add_request(pooled("e", 17))
    sched.add_request(pooled("ok", 16))
    assert sched.num_waiting == 1


@pytest.mark.parametrize("pooling_type,num_cached", [("mean", 0), ("cls", 0), ("last", 8)])
def test_prefix_hits_only_for_last_pooling(make_scheduler, make_request, pooling_type,
                                           num_cached) -> None:
    sched = make_scheduler(num_blocks=20, block_size=4)
    sched.add_request(make_request("g", 10, max_tokens=1))
    run_pooled_step(sched)
    sched.add_request(pooled("e", 10, pooling_type))
    out, _ = run_pooled_step(sched)
    # Blocks [0,4) and [4,8) are cached; "last" recomputes only the rest.
    assert out.scheduled_new_reqs[0].num_computed_tokens == num_cached
    assert out.num_scheduled_tokens == {"e": 10 - num_cached}


def test_aborted_pooled_request_ignores_late_output(make_scheduler) -> None:
    sched = make_scheduler()
    sched.add_request(pooled("e", 6))
    out = sched.schedule()
    sched.finish_requests("e", RequestStatus.FINISHED_ABORTED)
    runner = ModelRunnerOutput(req_ids=["e"], sampled_token_ids=[[]],
                               pooler_output={"e": [1.0]})
    assert sched.update_from_output(out, runner) == []
    assert not sched.has_unfinished_requests()
