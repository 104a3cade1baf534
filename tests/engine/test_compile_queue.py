"""SmallestFirstExecutor (engine/compile_queue.py): one thread, smallest call first."""

from __future__ import annotations

import threading

import pytest

from pagedllm.engine.compile_queue import SmallestFirstExecutor


def _hold(executor: SmallestFirstExecutor, size: float):
    """Occupy the thread until the returned Event is set (returns once it runs)."""
    started, gate = threading.Event(), threading.Event()

    def wait_for_gate() -> bool:
        started.set()
        return gate.wait(30)

    future = executor.submit(size, wait_for_gate)
    assert started.wait(30)
    return gate, future


@pytest.fixture
def executor():
    ex = SmallestFirstExecutor("test-queue")
    yield ex
    ex.shutdown()


def test_queued_calls_run_smallest_first_and_equal_sizes_in_arrival_order(executor):
    gate, running = _hold(executor, 100)  # the rest queue meanwhile
    order = []
    futures = [executor.submit(size, order.append, name)
               for size, name in [(50, "big"), (3, "small-1"), (7, "mid"), (3, "small-2")]]
    gate.set()
    for f in [running, *futures]:
        f.result(30)
    assert order == ["small-1", "small-2", "mid", "big"]


def test_results_and_exceptions_reach_the_futures(executor):
    assert executor.submit(1, pow, 2, 10).result(30) == 1024
    with pytest.raises(ZeroDivisionError):
        executor.submit(1, lambda: 1 / 0).result(30)
    assert executor.submit(1, str.upper, "ok").result(30) == "OK"  # the thread lives on


def test_a_cancelled_call_never_runs(executor):
    gate, _ = _hold(executor, 0)
    ran = []
    cancelled = executor.submit(1, ran.append, "cancelled")
    assert cancelled.cancel()
    after = executor.submit(2, ran.append, "after")
    gate.set()
    after.result(30)
    assert ran == ["after"]


def test_shutdown_cancels_what_waits_and_stops_the_thread():
    ex = SmallestFirstExecutor("test-queue", initializer=lambda: None)
    gate, running = _hold(ex, 0)
    waiting = ex.submit(1, print, "never")
    ex.shutdown()
    assert waiting.cancelled()
    gate.set()
    assert running.result(30) is True  # the call already running finishes
    ex._thread.join(30)
    assert not ex._thread.is_alive()
