"""Waiting queues of the scheduler, one per scheduling policy (fcfs | priority).

Both keep the order in which requests are admitted: the scheduler only ever looks at
the head (no skipping ahead, so a big request is never starved by small ones behind it).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from pagedllm.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    """Order under the "priority" policy: lower priority value first, then earlier arrival."""
    return request.priority, request.arrival_time


class RequestQueue(Protocol):
    """The waiting queue: `add` a new request, `prepend` a preempted one."""

    def add(self, request: Request) -> None: ...

    def prepend(self, request: Request) -> None: ...

    def peek(self) -> Request: ...

    def pop(self) -> Request: ...

    def remove(self, request: Request) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue:
    """Arrival order; a preempted request re-enters at the front (it arrived earliest)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Sorted by `priority_key`; equal keys keep insertion order.

    A preempted request re-enters by its own key, so it goes back ahead of every
    later-arriving request of its priority and behind every better one. A sorted list
    (not a heap) so that iteration is in admission order and the head is index 0;
    insertion is O(n) pointer moves, negligible next to a forward pass.
    """

    def __init__(self) -> None:
        self._queue: list[Request] = []

    def add(self, request: Request) -> None:
        bisect.insort_right(self._queue, request, key=priority_key)

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.pop(0)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "priority":
        return PriorityRequestQueue()
    assert policy == "fcfs", policy  # SchedulerConfig validates the name
    return FCFSRequestQueue()
