"""Steps in flight (pipeline parallelism): the scheduler may schedule again before the
last step's output is back. A request in flight is never scheduled twice, never chosen
as a preemption victim, and (pipeline_depth > 1) carries the token sampled for it to the
runners when it continues; a step holds at most max_num_seqs / pipeline_depth requests."""

from __future__ import annotations

from pagedllm.core.contracts import ModelRunnerOutput
from pagedllm.request import RequestStatus


def _run(sched, output, token=lambda r: 1000 + r.num_tokens):
    """The runner output of `output`: a token for every request now fully computed."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = sched.requests.get(req_id)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append([token(request)] if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def test_in_flight_requests_are_not_scheduled_again(make_scheduler, make_request):
    # max_num_seqs 4 over a pipeline of 2: at most 2 requests per step.
    sched = make_scheduler(max_num_seqs=4, pipeline_depth=2)
    reqs = [make_request(name, 5, max_tokens=3) for name in "abcde"]
    for r in reqs:
        sched.add_request(r)
    first = sched.schedule()
    assert list(first.num_scheduled_tokens) == ["a", "b"]
    second = sched.schedule()
    assert list(second.num_scheduled_tokens) == ["c", "d"]
    # a-d are in flight and max_num_seqs keeps e out: nothing to run.
    assert sched.schedule().is_empty and set(sched.in_flight) == {"a", "b", "c", "d"}
    sched.update_from_output(first, _run(sched, first))
    assert set(sched.in_flight) == {"c", "d"} and reqs[0].output_token_ids == [1005]
    third = sched.schedule()
    # The decodes carry the tokens sampled in the first step; the runners lack them.
    assert [(c.req_id, c.new_token_ids) for c in third.scheduled_cached_reqs] == [
        ("a", [1005]), ("b", [1005])]
    assert sched.schedule().is_empty  # all in flight again
    sched.update_from_output(second, _run(sched, second))
    sched.update_from_output(third, _run(sched, third))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, _run(sched, out))
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert [r.output_token_ids for r in reqs] == [[1005, 1006, 1007]] * 5


def test_chunked_prefill_sends_no_tokens_until_sampled(make_scheduler, make_request):
    sched = make_scheduler(max_num_batched_tokens=4, pipeline_depth=2)
    sched.add_request(make_request("a", 10, max_tokens=2))
    outputs = []
    for _ in range(3):
        out = sched.schedule()
        outputs.append(out)
        sched.update_from_output(out, _run(sched, out))
    # Chunks of 4, 4, 2: the last one samples.
    assert [o.num_scheduled_tokens["a"] for o in outputs] == [4, 4, 2]
    assert [c.new_token_ids for o in outputs[1:] for c in o.scheduled_cached_reqs] == [[], []]
    out = sched.schedule()
    assert out.scheduled_cached_reqs[0].new_token_ids == [1010]


def test_tokens_are_not_sent_without_pipeline(make_scheduler, make_request):
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=3))
    out = sched.schedule()
    sched.update_from_output(out, _run(sched, out))
    assert sched.schedule().scheduled_cached_reqs[0].new_token_ids == []


def test_in_flight_requests_are_never_preempted(make_scheduler, make_request):
    # 4 usable blocks of 4 tokens, caching off.
    sched = make_scheduler(num_blocks=5, enable_prefix_caching=False, pipeline_depth=2)
    a = make_request("a", 8, max_tokens=4)
    b = make_request("b", 8, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()  # both prefill: 2 blocks each, the pool is full
    sched.update_from_output(first, _run(sched, first))
    # Both now decode position 8 and need a 3rd block. b, the last running request and
    # so the usual victim, is in flight (as if scheduled in the step before): a
    # preempts itself instead.
    sched.in_flight["b"] += 1
    second = sched.schedule()
    assert second.preempted_req_ids == {"a"} and second.is_empty
    assert a.status == RequestStatus.PREEMPTED and b.status == RequestStatus.RUNNING
    assert sched.kv_cache_manager.get_block_ids("b") != [[]]
    del sched.in_flight["b"]
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, _run(sched, out))
    assert a.output_token_ids == b.output_token_ids == [1008, 1009, 1010, 1011]
    assert sched.kv_cache_manager.get_num_free_blocks() == 4
