"""CPU-heavy front-end work (tokenizing, chat templates) off the event loop, time-limited.

A 1 MB prompt takes about a second to tokenize and a large conversation as long to
render: on the event loop that is a second in which /health and every stream stall.
Small inputs (the common case, well under a millisecond) still run inline, since a
thread hop would only add latency; larger ones run in a small thread pool. The HF
tokenizer releases the GIL while it encodes; Python code (Jinja templates) shares it,
and the server's interpreter switch interval (1 ms, server.py) keeps the event loop
responsive.

Time limits: a call still running after `timeout_s` is answered with a 400. Tokenizing
is bounded by the prompt byte limit, so its thread soon ends by itself. A template
sent in a request is code and can loop for ever, so it runs under a trace function that
raises `RenderTimeout` inside it at the deadline, which frees the thread.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagedllm.errors import InvalidRequestError

T = TypeVar("T")

# Inputs below this many bytes are handled inline on the event loop.
INLINE_BYTES = 8192


class RenderTimeout(BaseException):
    """Raised inside a traced call at its deadline (a BaseException, so template code's
    `except Exception` cannot swallow it)."""


def call_with_deadline(deadline: float, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """Run fn in this thread, raising RenderTimeout in it once time.monotonic() passes
    `deadline` (checked on every traced line: slow, so only for untrusted code)."""
    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise RenderTimeout()
        return tracer

    sys.settrace(tracer)
    try:
        return fn(*args, **kw)
    finally:
        sys.settrace(None)


class Offloader:
    """Runs front-end work inline when small, else in worker threads with a time limit."""

    def __init__(self, timeout_s: float, num_threads: int = 2) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="pagedllm-front")
        # Structured-output constraint checks wait on their child process, one at a time
        # (seconds for a hostile one): a lane of their own, so the waits never hold the
        # threads that tokenize other requests.
        self._checks = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-check")

    async def run(self, what: str, size: int, fn: Callable[..., T], *args: Any,
                  untrusted: bool = False, **kw: Any) -> T:
        """fn(*args, **kw); `size` (bytes of input) decides inline vs thread; `untrusted`
        code always runs in a thread under the deadline tracer. `what` names the work
        in the timeout error."""
        if size < INLINE_BYTES and not untrusted:
            return fn(*args, **kw)
        loop = asyncio.get_running_loop()
        if untrusted:
            deadline = time.monotonic() + self.timeout_s
            future = loop.run_in_executor(
                self._pool, lambda: call_with_deadline(deadline, fn, *args, **kw))
        else:
            future = loop.run_in_executor(self._pool, lambda: fn(*args, **kw))
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except (asyncio.TimeoutError, RenderTimeout):
            raise InvalidRequestError(
                f"{what} took longer than {self.timeout_s:g} s (--render-timeout); "
                f"send a smaller input") from None

    async def run_in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker thread, with no time limit: the server's own work, bounded
        by what it was asked for, only too long to run on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def run_check(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the constraint checks' thread: no time limit here, as the check
        limits its own child process's CPU time; checks queue in arrival order."""
        return await asyncio.get_running_loop().run_in_executor(self._checks, fn, *args)

    def start_check(self, fn: Callable[[], Any]) -> None:
        """Queue fn() in the checks' thread without waiting for it (a warm-up)."""
        self._checks.submit(fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._checks.shutdown(wait=False, cancel_futures=True)
