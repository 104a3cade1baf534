"""Scheduler policy: budget, chunked prefill, preemption, FCFS, aborts, stop conditions.

Pools are tiny (block_size 4) so block ids, preemptions and budgets are exact.
"""

from __future__ import annotations

import pytest

from pagedllm.core.contracts import ModelRunnerOutput
from pagedllm.errors import InvalidRequestError
from pagedllm.request import Request, RequestStatus


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def by_length(request: Request) -> int:
    """Fake greedy model: the next token depends only on the request's own tokens."""
    return 1000 + request.num_tokens


def new_ids(output) -> list[str]:
    return [r.req_id for r in output.scheduled_new_reqs]


def cached_ids(output) -> list[str]:
    return [r.req_id for r in output.scheduled_cached_reqs]


def test_token_budget_and_max_num_seqs(make_scheduler, make_request, step) -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    for i, name in enumerate("abc"):
        sched.add_request(make_request(name, prompt(10, start=100 * i)))
    output, updated = step(sched)
    # a takes 10, b the remaining 6 (a chunk), c nothing.
    assert output.num_scheduled_tokens == {"a": 10, "b": 6}
    assert output.total_num_scheduled_tokens == 16
    assert [r.block_ids for r in output.scheduled_new_reqs] == [[[1, 2, 3]], [[4, 5]]]
    assert [r.req_id for r in updated] == ["a"]  # b's prefill is partial
    assert sched.num_running == 2 and sched.num_waiting == 1
    output, _ = step(sched)
    assert output.num_scheduled_tokens == {"a": 1, "b": 4, "c": 10}
    assert cached_ids(output) == ["a", "b"] and new_ids(output) == ["c"]

    capped = make_scheduler(max_num_seqs=2)
    for i, name in enumerate("xyz"):
        capped.add_request(make_request(name, prompt(3, start=100 * i)))
    output, _ = step(capped)
    assert list(output.num_scheduled_tokens) == ["x", "y"]


def test_chunked_prefill_splits_long_prompt(make_scheduler, make_request, step) -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    request = make_request("a", 20)
    sched.add_request(request)
    output, updated = step(sched, by_length)
    assert output.num_scheduled_tokens == {"a": 8}
    (new,) = output.scheduled_new_reqs
    assert new.block_ids == [[1, 2]] and new.num_computed_tokens == 0
    assert new.prompt_token_ids == prompt(20) and new.output_token_ids == []
    assert updated == [] and request.num_computed_tokens == 8
    output, updated = step(sched, by_length)
    (cached,) = output.scheduled_cached_reqs
    assert (cached.new_block_ids, cached.num_computed_tokens) == ([[3, 4]], 8)
    assert output.num_scheduled_tokens == {"a": 8} and updated == []
    output, updated = step(sched, by_length)
    (cached,) = output.scheduled_cached_reqs
    assert (cached.new_block_ids, cached.num_computed_tokens) == ([[5]], 16)
    assert output.num_scheduled_tokens == {"a": 4}
    assert updated == [request] and request.output_token_ids == [1020]
    # Decode: position 20 opens logical block 5: cdiv(21, 4) = 6 blocks.
    output, _ = step(sched, by_length)
    (cached,) = output.scheduled_cached_reqs
    assert (cached.new_block_ids, cached.num_computed_tokens) == ([[6]], 20)
    assert output.num_scheduled_tokens == {"a": 1}


def test_without_chunked_prefill_whole_prompt_must_fit(make_scheduler, make_request,
                                                       step) -> None:
    sched = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=16,
                           max_model_len=16)
    a, b = make_request("a", prompt(10)), make_request("b", prompt(10, start=50))
    sched.add_request(a)
    sched.add_request(b)
    output, _ = step(sched)
    assert output.num_scheduled_tokens == {"a": 10}
    assert b.status == RequestStatus.WAITING
    output, _ = step(sched)
    assert output.num_scheduled_tokens == {"a": 1, "b": 10}


def test_preemption_recomputes_and_finishes_correctly(make_scheduler, make_request,
                                                      step) -> None:
    # 4 usable blocks of 4 tokens; caching off so re-admission recomputes everything.
    sched = make_scheduler(num_blocks=5, enable_prefix_caching=False)
    a = make_request("a", prompt(7), max_tokens=6)
    b = make_request("b", prompt(7, start=100), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    output, _ = step(sched, by_length)
    assert [r.block_ids for r in output.scheduled_new_reqs] == [[[1, 2]], [[3, 4]]]
    step(sched, by_length)  # both decode position 7: cdiv(8, 4) = 2 blocks, no growth
    # a needs a 3rd block for position 8; none is free -> b (last) is preempted.
    output, _ = step(sched, by_length)
    assert output.preempted_req_ids == {"b"}
    assert cached_ids(output) == ["a"] and output.scheduled_cached_reqs[0].new_block_ids == [[4]]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [b] and sched.kv_cache_manager.get_block_ids("b") == [[]]
    assert b.output_token_ids == [1007, 1008]
    readmitted = None
    for _ in range(10):
        output, _ = step(sched, by_length)
        if "b" in new_ids(output):
            readmitted = output.scheduled_new_reqs[0]
            break
    assert a.status == RequestStatus.FINISHED_LENGTH and "a" in output.finished_req_ids
    assert readmitted is not None
    assert readmitted.prompt_token_ids == prompt(7, start=100)
    assert readmitted.output_token_ids == [1007, 1008]
    assert readmitted.num_computed_tokens == 0 and output.num_scheduled_tokens == {"b": 9}
    while sched.has_unfinished_requests():
        step(sched, by_length)
    # Same tokens as if b had never been preempted.
    assert b.output_token_ids == [1007, 1008, 1009, 1010, 1011, 1012]
    assert a.output_token_ids == [1007, 1008, 1009, 1010, 1011, 1012]
    assert sched.kv_cache_manager.get_num_free_blocks() == 4


def test_last_running_request_preempts_itself(make_scheduler, make_request, step) -> None:
    sched = make_scheduler(num_blocks=5, enable_prefix_caching=False)
    a = make_request("a", prompt(7))
    b = make_request("b", prompt(8, start=100))
    sched.add_request(a)
    sched.add_request(b)
    step(sched, by_length)
    # a still fits in 2 blocks; b needs a 3rd and is itself the last running request.
    output, _ = step(sched, by_length)
    assert output.num_scheduled_tokens == {"a": 1}
    assert output.preempted_req_ids == {"b"} and new_ids(output) == []
    assert sched.running == [a] and list(sched.waiting) == [b]
    assert sched.kv_cache_manager.get_num_free_blocks() == 2


def test_fcfs_big_request_is_not_overtaken(make_scheduler, make_request, step) -> None:
    sched = make_scheduler()  # 9 usable blocks
    sched.add_request(make_request("a", prompt(20), max_tokens=2))  # 5 blocks
    sched.add_request(make_request("big", prompt(20, start=100)))  # 5 blocks: no room
    sched.add_request(make_request("small", prompt(4, start=200)))  # 1 block would fit
    output, _ = step(sched)
    assert new_ids(output) == ["a"]
    output, _ = step(sched)
    assert new_ids(output) == [] and [r.req_id for r in sched.waiting] == ["big", "small"]
    output, _ = step(sched)  # a finished in the previous step
    assert output.finished_req_ids == {"a"}
    assert new_ids(output) == ["big", "small"]


def test_abort_frees_blocks(make_scheduler, make_request, step) -> None:
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", prompt(9)), make_request("b", prompt(5, start=50))
    sched.add_request(a)
    sched.add_request(b)
    output, _ = step(sched)
    assert sched.kv_cache_manager.get_num_free_blocks() == 6
    finished = sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert finished == [a, b]
    assert a.status.finish_reason == "abort" and b.is_finished
    assert sched.kv_cache_manager.get_num_free_blocks() == 9
    assert not sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 0
    assert sched.finish_requests("a", RequestStatus.FINISHED_ABORTED) == []
    # A late runner output for an aborted request is ignored.
    stale = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[3]])
    assert sched.update_from_output(output, stale) == [] and a.output_token_ids == [0]
    output = sched.schedule()
    assert output.is_empty and output.finished_req_ids == {"a", "b"}
    assert sched.schedule().finished_req_ids == set()


def test_prompt_larger_than_cache_is_rejected(make_scheduler, make_request) -> None:
    sched = make_scheduler(num_blocks=10)  # 9 usable blocks = 36 tokens
    with pytest.raises(InvalidRequestError, match=r"37 tokens needs 10 KV blocks.*only 9"):
        sched.add_request(make_request("a", 37))
    sched.add_request(make_request("b", 36))
    with pytest.raises(InvalidRequestError):
        sched.add_request(make_request("b", 3))  # duplicate id
    assert sched.num_waiting == 1


def run_to_end(sched, request: Request, tokens: list[int], step) -> None:
    sched.add_request(request)
    it = iter(tokens)
    for _ in range(len(tokens)):
        step(sched, lambda r: next(it))
        if request.is_finished:
            return


@pytest.mark.parametrize("kwargs, tokens, expected_output, status, stop_reason", [
    (dict(eos_token_id=2), [5, 2, 7], [5, 2], RequestStatus.FINISHED_STOPPED, None),
    (dict(eos_token_id=2, ignore_eos=True, max_tokens=3), [5, 2, 7], [5, 2, 7],
     RequestStatus.FINISHED_LENGTH, None),
    (dict(stop_token_ids=[9]), [5, 9, 7], [5, 9], RequestStatus.FINISHED_STOPPED, 9),
    (dict(eos_token_id=2, min_tokens=2), [2, 2, 3], [2, 2], RequestStatus.FINISHED_STOPPED,
     None),
    (dict(stop_token_ids=[9], min_tokens=3), [9, 9, 9], [9, 9, 9],
     RequestStatus.FINISHED_STOPPED, 9),
    (dict(max_tokens=2), [5, 5, 5], [5, 5], RequestStatus.FINISHED_LENGTH, None),
    # The last allowed token is EOS: "stop" wins over "length".
    (dict(eos_token_id=2, max_tokens=2), [5, 2], [5, 2], RequestStatus.FINISHED_STOPPED, None),
])
def test_stop_conditions(make_scheduler, make_request, step, kwargs, tokens,
                         expected_output, status, stop_reason) -> None:
    sched = make_scheduler()
    request = make_request("a", prompt(3), **kwargs)
    run_to_end(sched, request, tokens, step)
    assert request.output_token_ids == expected_output
    assert request.status == status and request.stop_reason == stop_reason
    assert sched.kv_cache_manager.get_num_free_blocks() == 9


def test_max_model_len_and_pool_capacity_end_with_length(make_scheduler, make_request,
                                                         step) -> None:
    sched = make_scheduler(max_model_len=10)
    request = make_request("a", prompt(8), max_tokens=None)
    run_to_end(sched, request, [5] * 5, step)
    assert request.output_token_ids == [5, 5] and request.status == RequestStatus.FINISHED_LENGTH
    # 2 usable blocks = 8 slots: a 9th token could never get a slot, so stop there.
    small = make_scheduler(num_blocks=3, max_model_len=64)
    request = make_request("b", prompt(6), max_tokens=None)
    run_to_end(small, request, [5] * 10, step)
    assert request.num_tokens == 9 and request.status == RequestStatus.FINISHED_LENGTH


def test_tokens_after_stop_in_one_step_are_dropped(make_scheduler, make_request) -> None:
    sched = make_scheduler()
    request = make_request("a", prompt(3), eos_token_id=2)
    sched.add_request(request)
    output = sched.schedule()
    runner_output = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5, 2, 7]])
    assert sched.update_from_output(output, runner_output) == [request]
    assert request.output_token_ids == [5, 2] and request.all_token_ids == prompt(3) + [5, 2]
    assert sched.finished_req_ids == {"a"}


def test_prefix_hit_through_scheduler(make_scheduler, make_request, step) -> None:
    sched = make_scheduler()
    run_to_end(sched, make_request("a", prompt(9), max_tokens=1), [5], step)
    b = make_request("b", prompt(9))
    sched.add_request(b)
    output, _ = step(sched)
    (new,) = output.scheduled_new_reqs
    # Blocks 1-2 (tokens 0..7) are hits; token 8 is computed in a fresh block.
    assert new.num_computed_tokens == 8 and output.num_scheduled_tokens == {"b": 1}
    assert new.block_ids[0][:2] == [1, 2] and b.num_cached_tokens == 8
    kv = sched.kv_cache_manager
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (18, 8)
