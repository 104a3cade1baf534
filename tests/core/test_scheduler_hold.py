"""Held admissions (Scheduler.hold_new_requests / release_held: the core's part of
pause_generation, modes "abort" and "wait"): requests that never ran, and new arrivals,
wait out of the queue while the running ones run on."""

from __future__ import annotations

from pagedllm.request import RequestStatus


def test_held_requests_wait_while_running_ones_finish(make_scheduler, make_request, step):
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", 3, max_tokens=3, arrival_time=0.0))
    sched.add_request(make_request("queued", 3, max_tokens=2, arrival_time=1.0))
    step(sched)  # "run" is admitted (one sequence at a time)
    sched.hold_new_requests()
    sched.add_request(make_request("late", 3, max_tokens=2, arrival_time=2.0))
    assert list(sched.held) == ["queued", "late"] and len(sched.waiting) == 0
    # Counted as waiting, not as work to do: an engine with only held requests idles.
    assert sched.num_waiting == 2 and sched.get_num_unfinished_requests() == 1
    finished = []
    for _ in range(4):
        if not sched.has_unfinished_requests():
            break
        output, done = step(sched)
        assert [r.req_id for r in output.scheduled_new_reqs] == []
        finished += [r.req_id for r in done if r.is_finished]
    assert finished == ["run"] and not sched.has_unfinished_requests()
    # An abort finds a held request.
    [aborted] = sched.finish_requests("late", RequestStatus.FINISHED_ABORTED)
    assert aborted.req_id == "late" and list(sched.held) == ["queued"]
    sched.release_held()
    assert sched.held is None and [r.req_id for r in sched.waiting] == ["queued"]
    output, _ = step(sched)
    assert [r.req_id for r in output.scheduled_new_reqs] == ["queued"]


def test_release_keeps_arrival_order_and_preempted_requests_stay_queued(
        make_scheduler, make_request):
    sched = make_scheduler()
    for i, name in enumerate(["a", "b", "c"]):
        sched.add_request(make_request(name, 3, arrival_time=float(i)))
    sched.waiting.remove(sched.requests["b"])  # "b" was preempted: it stays queued
    sched.requests["b"].num_preemptions = 1
    sched.waiting.add(sched.requests["b"])
    sched.hold_new_requests()
    assert list(sched.held) == ["a", "c"] and [r.req_id for r in sched.waiting] == ["b"]
    sched.hold_new_requests()  # a second hold changes nothing
    assert list(sched.held) == ["a", "c"]
    sched.release_held()
    assert [r.req_id for r in sched.waiting] == ["b", "a", "c"]


def test_held_requests_expire_without_a_step(make_scheduler, make_request):
    """Nothing schedules while only held requests are left: `expire` (the idle engine's
    call) still finishes those past their deadline."""
    now = [0.0]
    sched = make_scheduler(clock=lambda: now[0])
    sched.hold_new_requests()
    sched.add_request(make_request("soon", 3, deadline=1.0))
    sched.add_request(make_request("later", 3, deadline=5.0))
    sched.add_request(make_request("never", 3))
    assert sched.next_deadline() == 1.0 and not sched.has_unfinished_requests()
    assert sched.expire() == []
    now[0] = 2.0
    [expired] = sched.expire()
    assert expired.req_id == "soon" and expired.status == RequestStatus.FINISHED_TIMEOUT
    assert list(sched.held) == ["later", "never"] and sched.next_deadline() == 5.0
