"""StepFuture: the output of a step sent to the workers but not yet read back, and
StepsInFlight: the queue that settles them in the order they were sent."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any


class StepFuture:
    """The output of a step in flight. `result()` drives `resolve` (which reads the next
    answer and settles the oldest future in flight) until this one is settled: steps
    finish in the order they were sent."""

    def __init__(self, resolve: Callable[[], None]) -> None:
        self._resolve = resolve
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def set_result(self, value: Any) -> None:
        self._value, self._done = value, True

    def set_exception(self, error: BaseException) -> None:
        self._error, self._done = error, True

    def result(self) -> Any:
        while not self._done:
            self._resolve()
        if self._error is not None:
            raise self._error
        return self._value


class StepsInFlight:
    """Steps sent to the workers, oldest first, each with its future and a handle (what
    the executor needs to read its answer). `wait_oldest(handle)` returns the oldest
    step's output or raises; a raise fails every step in flight, since the group that
    would have answered them is dead."""

    def __init__(self, wait_oldest: Callable[[Any], Any]) -> None:
        self._wait_oldest = wait_oldest
        self._steps: deque[tuple[StepFuture, Any]] = deque()

    def __bool__(self) -> bool:
        return bool(self._steps)

    def add(self, handle: Any = None) -> StepFuture:
        future = StepFuture(self._resolve_oldest)
        self._steps.append((future, handle))
        return future

    def _resolve_oldest(self) -> None:
        future, handle = self._steps[0]
        try:
            output = self._wait_oldest(handle)
        except BaseException as e:
            while self._steps:
                self._steps.popleft()[0].set_exception(e)
            raise
        self._steps.popleft()
        future.set_result(output)
