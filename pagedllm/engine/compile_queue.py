"""One background thread that runs the calls it is given smallest first.

The grammar compiles of structured-output requests queue here. In arrival order, one
client's burst of huge grammars (each up to the compile limits: a minute of CPU) would
hold every other client's JSON schema behind them; smallest first, a schema of a few
hundred bytes waits at most for the one compile already running. Equal sizes keep their
arrival order.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class SmallestFirstExecutor:
    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        # (size, arrival number, future, fn, args); a None future stops the thread.
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._arrivals = itertools.count()
        self._initializer = initializer
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, size: float, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) after every queued call of a smaller size; its future."""
        future: Future = Future()
        self._queue.put((size, next(self._arrivals), future, fn, args))
        return future

    def shutdown(self) -> None:
        """Cancel what has not started; the thread exits after the call it runs."""
        while True:
            try:
                _, _, future, _, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                future.cancel()
        self._queue.put((float("-inf"), next(self._arrivals), None, None, ()))

    def _run(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            _, _, future, fn, args = self._queue.get()
            if future is None:
                return
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(e)
            else:
                future.set_result(result)
