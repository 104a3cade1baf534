"""StepFuture: the output of a step sent to the workers but not yet read back."""

from __future__ import annotations

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
