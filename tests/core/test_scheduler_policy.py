"""Scheduling policies (fcfs | priority) and per-request deadlines.

Pools are tiny (block_size 4) so block ids, victims and admissions are exact; deadlines
run on a fake clock (no sleeping).
"""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.request import RequestStatus


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def new_ids(output) -> list[str]:
    return [r.req_id for r in output.scheduled_new_reqs]


def cached_ids(output) -> list[str]:
    return [r.req_id for r in output.scheduled_cached_reqs]


def ids(requests) -> list[str]:
    return [r.req_id for r in requests]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.num_calls = 0

    def __call__(self) -> float:
        self.num_calls += 1
        return self.now


def test_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="scheduling policy must be one of"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8,
                        policy="lifo")


@pytest.mark.parametrize("policy, expected", [
    ("fcfs", ["a", "b", "c", "d"]),
    ("priority", ["b", "d", "c", "a"]),
])
def test_admission_order(make_scheduler, make_request, step, policy, expected) -> None:
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    for i, (name, priority) in enumerate([("a", 2), ("b", 0), ("c", 1), ("d", 0)]):
        sched.add_request(make_request(name, prompt(3, start=10 * i), max_tokens=1,
                                       priority=priority, arrival_time=float(i)))
    assert ids(sched.waiting) == expected
    admitted = []
    for _ in range(4):
        output, _ = step(sched)
        admitted += new_ids(output)
        assert output.preempted_req_ids == set()
    assert admitted == expected and not sched.has_unfinished_requests()


@pytest.mark.parametrize("policy, victim", [("fcfs", "b"), ("priority", "a")])
def test_preemption_victim(make_scheduler, make_request, step, policy, victim) -> None:
    # 4 usable blocks; caching off so blocks are freed for real.
    sched = make_scheduler(num_blocks=5, enable_prefix_caching=False, policy=policy)
    a = make_request("a", prompt(7), priority=1, arrival_time=0.0)
    b = make_request("b", prompt(7, start=100), priority=0, arrival_time=1.0)
    sched.add_request(a)
    sched.add_request(b)
    output, _ = step(sched)
    first, second = ("a", "b") if policy == "fcfs" else ("b", "a")
    assert new_ids(output) == [first, second]
    assert [r.block_ids for r in output.scheduled_new_reqs] == [[[1, 2]], [[3, 4]]]
    assert ids(sched.running) == [first, second]
    step(sched)  # both decode position 7 in their 2 blocks
    # A later equal-priority arrival: under priority the victim goes back ahead of it.
    sched.add_request(make_request("c", prompt(3, start=200), priority=1, arrival_time=5.0))
    # The first running request needs a 3rd block for position 8: the last one yields.
    output, _ = step(sched)
    survivor = "a" if victim == "b" else "b"
    assert output.preempted_req_ids == {victim}
    assert cached_ids(output) == [survivor] and new_ids(output) == []
    assert output.scheduled_cached_reqs[0].new_block_ids == [[4]]
    assert ids(sched.running) == [survivor]
    assert ids(sched.waiting) == [victim, "c"]
    assert sched.requests[victim].status == RequestStatus.PREEMPTED


def test_high_priority_arrival_preempts_when_max_num_seqs_is_full(
        make_scheduler, make_request, step) -> None:
    sched = make_scheduler(max_num_seqs=2, policy="priority")
    sched.add_request(make_request("a", prompt(3), priority=1, arrival_time=0.0))
    sched.add_request(make_request("b", prompt(3, start=10), priority=1, arrival_time=1.0))
    step(sched)
    # Equal priority: c waits, nobody is preempted.
    sched.add_request(make_request("c", prompt(3, start=20), priority=1, arrival_time=2.0))
    output, _ = step(sched)
    assert output.preempted_req_ids == set() and new_ids(output) == []
    assert output.num_scheduled_tokens == {"a": 1, "b": 1}
    # Better priority: the worst running request (b: priority 1, latest) makes room and
    # d starts in the same step (an admission preemption does not block admission).
    sched.add_request(make_request("d", prompt(3, start=30), priority=0, arrival_time=3.0))
    output, _ = step(sched)
    assert output.preempted_req_ids == {"b"}
    assert new_ids(output) == ["d"] and cached_ids(output) == ["a"]
    assert output.num_scheduled_tokens == {"a": 1, "d": 3}
    assert ids(sched.running) == ["d", "a"] and ids(sched.waiting) == ["b", "c"]
    assert sched.requests["b"].num_computed_tokens == 0 and sched.num_preemptions == 1
    assert sched.kv_cache_manager.get_block_ids("b") == [[]]


def test_fcfs_ignores_priority(make_scheduler, make_request, step) -> None:
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("a", prompt(3), priority=1, arrival_time=0.0))
    sched.add_request(make_request("b", prompt(3, start=10), priority=1, arrival_time=1.0))
    step(sched)
    sched.add_request(make_request("d", prompt(3, start=30), priority=0, arrival_time=3.0))
    output, _ = step(sched)
    assert output.preempted_req_ids == set() and new_ids(output) == []
    assert ids(sched.running) == ["a", "b"] and ids(sched.waiting) == ["d"]


def test_high_priority_arrival_preempts_for_blocks(make_scheduler, make_request,
                                                   step) -> None:
    sched = make_scheduler(num_blocks=5, enable_prefix_caching=False, policy="priority")
    sched.add_request(make_request("a", prompt(7), priority=1, arrival_time=0.0))
    sched.add_request(make_request("b", prompt(7, start=100), priority=1, arrival_time=1.0))
    step(sched)
    assert sched.kv_cache_manager.get_num_free_blocks() == 0
    # h needs 2 blocks and none is free: b (latest of the worse ones) is preempted.
    sched.add_request(make_request("h", prompt(5, start=200), priority=0, arrival_time=2.0))
    output, _ = step(sched)
    assert output.preempted_req_ids == {"b"}
    assert cached_ids(output) == ["a"] and new_ids(output) == ["h"]
    # b's blocks were freed last-first: h gets 4 then 3.
    assert output.scheduled_new_reqs[0].block_ids == [[4, 3]]
    assert ids(sched.running) == ["h", "a"] and ids(sched.waiting) == ["b"]


def test_no_preemption_when_it_cannot_make_room(make_scheduler, make_request, step) -> None:
    sched = make_scheduler(num_blocks=5, enable_prefix_caching=False, policy="priority")
    sched.add_request(make_request("x", prompt(7), priority=0, arrival_time=0.0))
    sched.add_request(make_request("y", prompt(7, start=100), priority=2, arrival_time=1.0))
    step(sched)
    # h (3 blocks) beats y, but y's 2 blocks are not enough: preempting y is useless.
    sched.add_request(make_request("h", prompt(12, start=200), priority=1, arrival_time=2.0))
    output, _ = step(sched)
    assert output.preempted_req_ids == set() and new_ids(output) == []
    assert ids(sched.running) == ["x", "y"] and ids(sched.waiting) == ["h"]


def test_deadlines_expire_waiting_and_running_requests(make_scheduler, make_request,
                                                       step) -> None:
    clock = FakeClock()
    sched = make_scheduler(max_num_seqs=1, clock=clock)
    a = make_request("a", prompt(9), max_tokens=None, deadline=10.0)
    w = make_request("w", prompt(5, start=50), deadline=5.0)
    c = make_request("c", prompt(6, start=80), max_tokens=2)
    for request in (a, w, c):
        sched.add_request(request)
    output, _ = step(sched)
    assert new_ids(output) == ["a"] and sched.pop_timed_out_requests() == []
    assert sched.kv_cache_manager.get_num_free_blocks() == 6
    clock.now = 4.9
    output, _ = step(sched)
    assert output.finished_req_ids == set() and sched.num_waiting == 2
    clock.now = 5.0  # a deadline equal to now has passed
    output, _ = step(sched)
    assert output.finished_req_ids == {"w"} and cached_ids(output) == ["a"]
    assert w.status == RequestStatus.FINISHED_TIMEOUT and w.status.finish_reason == "timeout"
    assert sched.pop_timed_out_requests() == [w] and sched.pop_timed_out_requests() == []
    assert ids(sched.waiting) == ["c"] and "w" not in sched.requests
    clock.now = 11.0
    output, _ = step(sched)
    # a timed out while running: its 3 blocks are free at once, so c starts this step.
    assert output.finished_req_ids == {"a"} and new_ids(output) == ["c"]
    assert a.status == RequestStatus.FINISHED_TIMEOUT and a.output_token_ids == [0, 0, 0]
    assert sched.pop_timed_out_requests() == [a]
    assert sched.kv_cache_manager.get_block_ids("a") == [[]]
    assert sched.kv_cache_manager.get_num_free_blocks() == 9 - 2
    step(sched)
    assert c.status == RequestStatus.FINISHED_LENGTH and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.get_num_free_blocks() == 9


def test_all_timed_out_gives_an_empty_step(make_scheduler, make_request, step) -> None:
    clock = FakeClock()
    sched = make_scheduler(clock=clock)
    sched.add_request(make_request("a", prompt(5), deadline=1.0))
    sched.add_request(make_request("b", prompt(5, start=50), deadline=2.0))
    step(sched)
    clock.now = 2.0
    output = sched.schedule()
    assert output.is_empty and output.finished_req_ids == {"a", "b"}
    assert ids(sched.pop_timed_out_requests()) == ["a", "b"]
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.get_num_free_blocks() == 9


def test_deadline_bookkeeping(make_scheduler, make_request, step) -> None:
    clock = FakeClock()
    sched = make_scheduler(clock=clock)
    # Without deadlines the clock is never read.
    sched.add_request(make_request("r", prompt(3), max_tokens=1))
    step(sched)
    assert clock.num_calls == 0
    # r finishes before its deadline; a later request reuses the id without one.
    sched.add_request(make_request("r", prompt(3), max_tokens=1, deadline=3.0))
    step(sched)
    assert sched.requests == {}
    sched.add_request(make_request("r", prompt(3, start=10), max_tokens=2))
    clock.now = 3.0
    step(sched)
    assert sched.requests["r"].status == RequestStatus.RUNNING
    assert sched.pop_timed_out_requests() == []
    # Stale entries of requests that finished otherwise do not pile up.
    for i in range(200):
        sched.add_request(make_request(f"x{i}", prompt(3), deadline=100.0 + i))
    sched.finish_requests([f"x{i}" for i in range(200)], RequestStatus.FINISHED_ABORTED)
    step(sched)
    assert len(sched._deadlines) == 0
