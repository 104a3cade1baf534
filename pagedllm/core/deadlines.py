"""Request deadlines: which live requests are due for FINISHED_TIMEOUT."""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from pagedllm.request import Request


class DeadlineHeap:
    """Min-heap of (deadline, req_id) of requests added with a deadline.

    Entries of requests that finished otherwise are dropped lazily, when they reach the
    top or when `compact` finds them dominating the heap.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def earliest(self) -> float | None:
        """The earliest deadline held (perhaps of a request already finished: a stale
        entry only wakes its caller early)."""
        return self._heap[0][0] if self._heap else None

    def push(self, request: Request) -> None:
        assert request.deadline is not None
        heapq.heappush(self._heap, (request.deadline, request.req_id))

    def pop_expired(self, now: float, requests: Mapping[str, Request]) -> list[str]:
        """Ids of the live `requests` whose deadline is <= now (their entries leave)."""
        heap = self._heap
        expired: list[str] = []
        while heap and heap[0][0] <= now:
            deadline, req_id = heapq.heappop(heap)
            request = requests.get(req_id)
            # Lazy deletion: the request may have finished already (or its id been
            # reused by a later request, whose own entry is elsewhere in the heap).
            if request is not None and request.deadline == deadline:
                expired.append(req_id)
        return expired

    def compact(self, requests: Mapping[str, Request]) -> None:
        """Entries of requests that finished early linger until their deadline: rebuild
        from the live `requests` when they dominate, so the heap stays O(live requests)
        (amortized O(1) per entry)."""
        if len(self._heap) > 2 * len(requests) + 64:
            self._heap = [(r.deadline, r.req_id) for r in requests.values()
                          if r.deadline is not None]
            heapq.heapify(self._heap)
